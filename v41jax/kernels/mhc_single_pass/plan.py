"""Static tiling choices of the Single-Pass kernels, their on-chip memory and HBM traffic.

``make_plan(target, ...)`` picks the token block ``bt`` and the C tile ``tc`` of one kernel
variant ("tpu": Mosaic TPU, "gpu": Triton) for a problem ``[N tokens, n streams, C]`` and
raises a ``ValueError`` naming the value and the limit when the kernel cannot take the shape
(tile divisibility, VMEM / shared-memory need): the check runs before any lowering.

``block_traffic(grid, blocks)`` is the HBM traffic implied by a kernel's BlockSpecs: every
block is moved when its block index differs from the previous grid step's (the TPU
pipeline's rule: a block with a constant index map, such as phi, is fetched once). The
kernels build their specs with ``kernel.block_specs`` and the same list feeds this count,
the ``pl.CostEstimate`` and the benchmark, so the reported bytes are the kernel's own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from v41jax.kernels.platforms import TPU_MAX_VMEM

TARGETS = ("tpu", "gpu")
# TPU: VMEM budget of the tiles we choose (v5e's default scoped limit is 16 MiB, v6e/v7x's
# 32 MiB; physical VMEM is 64 MiB on v7x): the kernel asks for its need plus headroom via
# ``vmem_limit_bytes``, and shapes needing more than the hard limit are refused.
TPU_VMEM_BUDGET = 24 << 20
TPU_VMEM_HARD_LIMIT = TPU_MAX_VMEM  # 48 MiB: under v7x's 64 MiB, room for Mosaic scratch
TPU_VMEM_HEADROOM = 4 << 20
# The whole-C form's limit, times its modelled need: the model is an upper bound of what
# Mosaic reserves on v5e (C = 1000 bf16, 1024 tokens: 8.8 MB used, 12.1 modelled), but v5p
# reserved 17.9 MB for the same kernel (compiled for v5p:2x2x2, tests/aot).
WHOLE_C_VMEM_FACTOR = 2
# GPU: H100/H200 allow 227 KiB of shared memory per block (232448 bytes).
GPU_SMEM_LIMIT = 232448
GPU_NUM_WARPS = 8
GPU_NUM_STAGES = 2
GPU_TILE_ELEMS = 4096  # bt x tc f32 elements per live tile (register pressure, 8 warps)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static choices of one call (hashable: a nondiff argument of the custom_vjp)."""

    target: str  # "tpu" | "gpu": which kernel variant
    norm_eps: float
    out_dtype: Any
    block_tokens: int
    block_c: int
    pad_k_to: int | None  # GPU: Triton tensors must have power-of-two sizes
    interpret: bool
    vmem_limit_bytes: int | None = None  # TPU only


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def tpu_vmem_bytes(bt, tc, n, c, k, x_item, out_item, with_norm, with_stats) -> int:
    """VMEM of the TPU kernel: double-buffered blocks, counted padded to the (8 x packing,
    128) tile. C tiles of 128-lane multiples take the stream-major form (n stream tiles, y
    and one X_{l+1} tile of [bt, tc]; the resident h block [bt, C] and its f32 scratch);
    otherwise the whole-C form ([bt, n, C] X blocks in and out; y and h [bt, C]), whose X
    blocks take (4, 128) tiles (each token's n rows padded to a multiple of 4, as the TPU
    compiler lays out [N, 4, C]). An upper bound of what Mosaic reports using
    (``used_scoped_memory_configs``; n = 4, K = 24, v5e), e.g. C = 1000 bf16 at bt = 256:
    12.6 MB modelled, 8.8 MB used; f32: 22.8 vs 17.4; C = 1024, bt = 256, tc = 512: 7.5 vs
    6.4 (bf16), 11.7 vs 10.2 (f32)."""
    pad = lambda rows, cols, item: (
        -(-rows // (8 * max(1, 4 // item))) * 8 * max(1, 4 // item) * (-(-cols // 128) * 128) * item
    )
    if tc % 128 == 0:
        total = 2 * (n + 2) * pad(bt, tc, x_item)
        total += 2 * pad(bt, c, out_item) + pad(bt, c, 4) + pad(bt, 1, 4)
    else:
        x_block = bt * -(-n // 4) * 4 * -(-c // 128) * 128 * x_item
        total = 2 * (2 * x_block + pad(bt, c, x_item) + pad(bt, c, out_item))
    total += 2 * (pad(bt, n * n, 4) + 2 * pad(bt, n, 4))  # h_res, h_post, a_pre
    if with_norm:
        total += 2 * pad(1, c, 4)
    if with_stats:
        total += 2 * n * pad(k, c, 4) + 2 * (pad(bt, k, 4) + pad(bt, 1, 4))
    return total


def gpu_smem_bytes(bt, tc, kp, with_stats) -> int:
    """Shared memory Triton needs (an estimate): the dot's operands, staged num_stages deep;
    the elementwise tiles stay in registers."""
    return GPU_NUM_STAGES * (bt * tc + tc * kp) * 4 if with_stats else 0


def _tile_choices(c: int, candidates: Sequence[int]) -> list[int]:
    return [t for t in candidates if t <= c and c % t == 0]


def make_plan(
    target: str,
    *,
    num: int,
    n: int,
    c: int,
    k: int | None,
    x_item: int,
    out_item: int,
    with_norm: bool,
    norm_eps: float,
    out_dtype,
    block_tokens: int | None = None,
    block_c: int | None = None,
    interpret: bool = False,
) -> Plan:
    """The plan of kernel ``target`` for N=num tokens, or ValueError naming the limit."""
    with_stats = k is not None

    def fail(msg: str):
        raise ValueError(f"mhc_single_pass ({target} kernel): {msg}")

    if target == "tpu":
        if block_c is not None and c % block_c:
            fail(f"C={c} is not a multiple of block_c={block_c}")
        if block_c is not None and block_c != c and block_c % 128:
            fail(f"block_c={block_c} must be a multiple of 128 (TPU lanes) or equal C={c}")
        # A C tile is a multiple of 128 lanes dividing C, or all of C when none divides it.
        tiles = [block_c] if block_c else (_tile_choices(c, (512, 256, 128)) or [c])
        if block_tokens is not None and block_tokens % 8 and block_tokens < num:
            fail(f"block_tokens={block_tokens} must be a multiple of 8 (TPU sublanes)")
        cap = -(-num // 8) * 8
        bts = [block_tokens] if block_tokens else [b for b in (256, 128, 64, 32, 16, 8)]
        bts = [min(b, cap) for b in bts]
        need = lambda b, t: tpu_vmem_bytes(b, t, n, c, k, x_item, out_item, with_norm, with_stats)
        fits = [(b, t) for b in bts for t in tiles if need(b, t) <= TPU_VMEM_BUDGET]
        if not fits:
            b, t = bts[-1], tiles[-1]
            if need(b, t) > TPU_VMEM_HARD_LIMIT:
                fail(
                    f"VMEM need {need(b, t)} bytes at block_tokens={b}, block_c={t} exceeds "
                    f"the limit {TPU_VMEM_HARD_LIMIT} (n={n}, C={c}, K={k})"
                )
            fits = [(b, t)]
        bt, tc = fits[0]
        vmem = need(bt, tc) + TPU_VMEM_HEADROOM
        if tc % 128:  # whole-C form: Mosaic's own scratch for it differs by generation
            vmem = max(vmem, WHOLE_C_VMEM_FACTOR * need(bt, tc))
        vmem = min(vmem, TPU_VMEM_HARD_LIMIT)
        return Plan("tpu", norm_eps, out_dtype, bt, tc, None, interpret, vmem)
    if target != "gpu":
        raise ValueError(f"mhc_single_pass: kernel target must be one of {TARGETS}, got {target!r}")
    bt = block_tokens or 16
    if not _pow2(bt):
        fail(f"block_tokens={bt} must be a power of two (Triton tensor sizes)")
    if with_stats and bt < 16:
        fail(f"block_tokens={bt} must be >= 16 with statistics (Triton dot operands)")
    tiles = [block_c] if block_c else _tile_choices(c, (256, 128, 64, 32, 16))
    tiles = [t for t in tiles if bt * t <= GPU_TILE_ELEMS] or tiles[-1:]
    if not tiles or not _pow2(tiles[0]) or c % tiles[0] or tiles[0] < (16 if with_stats else 1):
        fail(f"C={c} needs a power-of-two tile >= 16 dividing it (block_c={block_c})")
    tc = tiles[0]
    kp = None if k is None else max(16, 1 << (k - 1).bit_length())
    smem = gpu_smem_bytes(bt, tc, kp or 0, with_stats)
    if smem > GPU_SMEM_LIMIT:
        fail(f"shared memory need {smem} bytes exceeds max {GPU_SMEM_LIMIT} (bt={bt}, tc={tc})")
    return Plan("gpu", norm_eps, out_dtype, bt, tc, kp, interpret)


Block = tuple[tuple[int, ...], Callable[..., tuple[int, ...]], int]  # shape, index map, item


def block_traffic(grid: tuple[int, ...], blocks: Sequence[Block]) -> int:
    """Bytes moved between HBM and the kernel: for each block, its bytes times the number of
    grid steps (row-major order) whose block index differs from the previous step's."""
    total = 0
    for shape, index_map, item in blocks:
        moves, last = 0, None
        for idx in itertools.product(*map(range, grid)):
            cur = tuple(int(v) for v in index_map(*idx))
            moves += cur != last
            last = cur
        total += moves * math.prod(shape) * item
    return total


def item(dtype) -> int:
    return np.dtype(dtype).itemsize
