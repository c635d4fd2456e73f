"""Limits and costs of the compiled verification kernels (``kernel.py``).

``check_block_v`` is the one place that says which vocabulary blocks a compiled kernel takes
(TPU: a multiple of 128 lanes or the whole row, within VMEM; GPU: a power of two within
Triton's tensor size); the API and the kernels both call it, so a block a kernel cannot
take is a ValueError naming the limit before anything is lowered.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from v41jax.kernels.platforms import (
    TPU_MAX_VMEM,
    TRITON_MAX_NUMEL,
    round_up,
    tpu_vmem_bytes,
    tpu_vmem_limit,
)

# Mosaic keeps some of the kernel's [rows, bv] f32 values (race keys, selects, the residual)
# in VMEM scratch of its own, beside the pipeline's blocks. Measured on v5e (libtpu 0.0.42,
# ``used_scoped_memory_configs`` minus the blocks) in arrays of [round_up(K+1, 8), bv] f32:
# up to 1.95 at K+1 <= 8 (one-hot drafts at K = 7, bv = 98,304; 0.95 with draft laws), 2.4
# with one-hot drafts and 5.4 with draft laws at K = 15 (bv = 32,768 and 65,536). Modelled
# as 2, 3 and 6 such arrays (``tests/aot/test_aot_spec_verify.py`` checks the model bounds
# what Mosaic reports).
_TEMPS_SMALL, _TEMPS_ONE_HOT, _TEMPS_LAWS = 2, 3, 6


def blocked_vmem_bytes(k: int, block_v: int, itemsize: int = 4, has_q: bool = True) -> int:
    """VMEM of ``spec_verify_blocked``: double-buffered p [K+1, bv], q [K, bv], w [1, bv]
    blocks (``itemsize`` bytes each), the per-row [K, 1] blocks and the scratch columns,
    plus Mosaic's own scratch for the [K+1, bv] f32 values (calibrated, see above).

    Blocks alone underestimated what Mosaic reserves by up to 2x (K = 15, draft laws): a
    whole-row block (bv = V = 129,280, K = 7, one-hot) asked for 30 MiB and needed more.
    """
    dt = {1: jnp.int8, 2: jnp.bfloat16, 4: jnp.float32}[itemsize]
    vocab = sum(tpu_vmem_bytes(rows, block_v, dt) for rows in (k + 1, k, 1))
    column = tpu_vmem_bytes(k + 1, 1, jnp.float32)  # every [n <= K+1, 1] buffer pads to this
    rows = round_up(k + 1, 8)
    temps = _TEMPS_SMALL if rows <= 8 else (_TEMPS_LAWS if has_q else _TEMPS_ONE_HOT)
    scratch = temps * tpu_vmem_bytes(rows, block_v, jnp.float32)
    return 2 * vocab + 2 * 5 * column + 7 * column + scratch


def check_block_v(
    kind: str, block_v: int, vocab: int, k: int = 8, itemsize: int = 4, has_q: bool = True
) -> int:
    """The block a compiled ``kind`` ("blocked" on TPU, "rowloop" on GPU) kernel uses for
    ``block_v``, or a ValueError naming the limit it breaks. On TPU the VMEM limit the
    kernel would ask for (``tpu_vmem_limit`` of ``blocked_vmem_bytes``) must be within
    ``TPU_MAX_VMEM``."""
    if kind == "rowloop":
        if block_v & (block_v - 1):
            raise ValueError(f"spec_verify: block_v must be a power of two on GPU, got {block_v}")
        if block_v > TRITON_MAX_NUMEL:
            raise ValueError(
                f"spec_verify: block_v = {block_v} is over Triton's {TRITON_MAX_NUMEL} elements "
                "per tensor"
            )
        return min(block_v, 1 << (vocab - 1).bit_length())  # no more than the next 2^n >= V
    if block_v % 128 and block_v < vocab:
        raise ValueError(
            f"spec_verify: block_v must be a multiple of 128 (TPU lanes) or >= V = {vocab} on "
            f"TPU, got {block_v}"
        )
    bv = min(block_v, vocab)
    need = blocked_vmem_bytes(k, bv, itemsize, has_q)
    if (limit := tpu_vmem_limit(need) or need) > TPU_MAX_VMEM:
        raise ValueError(
            f"spec_verify: block_v = {bv} at K = {k} needs {need} bytes of VMEM ({limit} "
            f"with the compiler's headroom), over the {TPU_MAX_VMEM >> 20} MiB limit "
            f"({TPU_MAX_VMEM} bytes); lower block_v"
        )
    return bv


def verify_cost(b: int, k: int, vocab: int, args) -> pl.CostEstimate:
    """One pass: p, q, w read once; per column ~4 ops for each of the K+1 p races and ~8 for
    each of the K draft rows; one log1p per column of w."""
    nbytes = sum(a.size * a.dtype.itemsize for a in args if a is not None) + 4 * b * (k + 2)
    flops = b * vocab * (4 * (k + 1) + 8 * k)
    return pl.CostEstimate(flops=flops, transcendentals=b * vocab, bytes_accessed=nbytes)
