"""Entry point of the Engram lookup: validation, implementation dispatch, custom gradient.

``engram_lookup(table, ids, row_scale)`` gathers each token's H rows of the flat Engram
table (ids already offset per head), dequantises FP8 rows with their per-row scale and
returns the concatenation ``[..., H*E]`` (see ``reference.py`` for the equation).

Implementations (``impl``):
  "xla"        one flat ``lax.gather`` of the ``N*H`` rows into ``[N*H, E]`` (a free reshape
               of ``[N, H*E]``), fused with the dequantisation. On CPU, for f32 tables of
               16 MiB and more, the rows are gathered in chunks whose cache lines are touched
               first (``_gather_rows_touched``): 1.40x the bytes/s of ``jnp.take`` on the
               2 GB table of ``python -m v41jax.bench engram``
               (``experiments/benchmarks/engram.json``, ``bandwidth``).
  "pallas"     the Pallas kernel of the platform: ``engram_lookup_dma`` on TPU (and, with
               ``interpret=True``, on CPU), ``engram_lookup_vector`` on GPU.
  "pallas_tpu" / "pallas_gpu"  pick one of the two kernels explicitly (tests, debugging).
  "reference"  ``engram_lookup_reference`` (plain jnp indexing).
  "auto"       "xla" on CPU; "pallas" on TPU/GPU when the kernel takes the shape, else "xla".

Dispatch is by the platform the program is LOWERED for (``platforms.by_platform``), not
the default backend at trace time: one jitted call lowered for TPU, GPU or CPU holds the
kernel of that platform, and only the CPU branch has the CPU touch gather. A Pallas
choice a platform cannot compile (``impl="pallas_tpu"`` lowered for CPU without
``interpret=True``, a shape the kernel cannot take under ``impl="pallas"``) raises a
ValueError naming the limit when the program is lowered for that platform; an explicit
``"pallas_tpu"``/``"pallas_gpu"`` with a shape its kernel cannot take raises at the call.

Gradient (every impl): a ``jax.custom_vjp`` whose backward scatter-adds the output
cotangent rows into a table-shaped gradient, ``d_table = zeros.at[ids].add(g * s[ids])``
(duplicate ids accumulate, in float32), and ``d_scale = zeros.at[ids].add(sum_E(g * q[ids]))``.
Ids get no gradient. An FP8 table gets a zero gradient: FP8 is a storage format for
inference; training differentiates the float32/bf16 master and fake-quantises the gathered
rows (``v41jax.engram.fp8.fake_quantize_rows``), which equals gathering the exported table.

Contract on ids: they are NOT range-checked inside jit (a check would force a host sync or
a data-dependent error). Out-of-range ids are undefined behaviour: XLA clamps them today,
the Pallas kernels may read outside the table. Call ``check_ids`` on host data to verify.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from v41jax.kernels.engram_lookup import kernel as _kernel
from v41jax.kernels.engram_lookup.reference import engram_lookup_reference
from v41jax.kernels.platforms import (
    TPU_MAX_VMEM,
    TRITON_MAX_NUMEL,
    by_platform,
    unsupported,
)

IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "reference")

# Row gather [R, E] x [M] -> [M, E]: each index picks one whole row.
_ROW_GATHER = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
)
# Element gather [R, E] x [..., 2] -> [...]: each (row, col) pair picks one element.
_ELEMENT_GATHER = lax.GatherDimensionNumbers(
    offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0, 1)
)
_IN_BOUNDS = lax.GatherScatterMode.PROMISE_IN_BOUNDS

# CPU "touch" gather (see _gather_rows_touched): rows per chunk (2048 x 256 B rows = 512 KiB
# stays in L2), and the smallest f32 table it is used for: tables of a few MiB stay cache
# resident in steady state, where touching first gains nothing (the recorded comparison is
# the 2 GB table of experiments/benchmarks/engram.json, 1.40x jnp.take).
TOUCH_CHUNK_ROWS = 2048
TOUCH_MIN_TABLE_BYTES = 16 << 20


def _gather_rows(table_RxE: jax.Array, ids_M: jax.Array) -> jax.Array:
    """``table[ids]`` as one flat XLA gather, ``[M, E]``.

    PROMISE_IN_BOUNDS skips the negative-index wrap and masking that jnp indexing adds;
    XLA's gather still clamps, so a bad id cannot read outside the buffer.
    """
    return lax.gather(
        table_RxE, ids_M[:, None], _ROW_GATHER, (1, table_RxE.shape[1]), mode=_IN_BOUNDS
    )


def _gather_rows_touched(table_RxE: jax.Array, ids_M: jax.Array, chunk: int) -> jax.Array:
    """``table[ids]`` in chunks of ``chunk`` ids, each chunk's cache lines touched first.

    Why: on CPU, XLA copies a gathered row element by element, and that loop keeps only
    about one row's cache misses in flight, so a gather from a table far larger than cache
    is latency bound (``jnp.take``: 9.2% of memcpy on the 2 GB table of
    ``experiments/benchmarks/engram.json``). A first gather of one element per 64-byte line
    of the chunk's rows is a short loop with many misses in flight; it pulls the rows into
    cache and the row gather that follows hits (12.9% of memcpy there, 1.40x ``jnp.take``).
    The touched values feed a data-dependent zero added to the ids, so XLA must run the
    touch first and cannot drop it. Only for 4-byte dtypes: XLA CPU gathers bf16/fp8 via
    a wider float (or a uint view), and inside the loop that becomes a converted copy of
    the whole table per call (far slower; not recorded in a benchmark JSON).
    """
    num_ids = ids_M.shape[0]
    emb = table_RxE.shape[1]
    per_line = 64 // table_RxE.dtype.itemsize
    cols = jnp.asarray(sorted(set(range(0, emb, per_line)) | {emb - 1}), jnp.int32)
    num_chunks = -(-num_ids // chunk)
    ids_CxK = jnp.pad(ids_M, (0, num_chunks * chunk - num_ids)).reshape(num_chunks, chunk)

    def one_chunk(carry, ids_K):
        rows_KxL = jnp.broadcast_to(ids_K[:, None], (chunk, cols.shape[0]))
        cols_KxL = jnp.broadcast_to(cols[None, :], (chunk, cols.shape[0]))
        where_KxLx2 = jnp.stack([rows_KxL, cols_KxL], axis=-1)
        touched = lax.gather(table_RxE, where_KxLx2, _ELEMENT_GATHER, (1, 1), mode=_IN_BOUNDS)
        zero = jnp.minimum(jnp.sum(jnp.isnan(touched).astype(jnp.int32)), 0)
        return carry, _gather_rows(table_RxE, ids_K + zero)

    _, rows_CxKxE = lax.scan(one_chunk, None, ids_CxK)
    return rows_CxKxE.reshape(-1, emb)[:num_ids]


def _lookup_xla(table_RxE, ids_M, row_scale_R, out_dtype, touch_chunk: int) -> jax.Array:
    if touch_chunk:
        rows_MxE = _gather_rows_touched(table_RxE, ids_M, touch_chunk)
    else:
        rows_MxE = _gather_rows(table_RxE, ids_M)
    if row_scale_R is None:
        return rows_MxE.astype(out_dtype)
    scale_M = row_scale_R.at[ids_M].get(mode="promise_in_bounds")
    return (rows_MxE.astype(jnp.float32) * scale_M[:, None]).astype(out_dtype)


def _touch_chunk(table, num_ids: int) -> int:
    """Chunk size of the CPU touch gather for this call, 0 where a flat gather is better.
    Used only in the CPU branch: accelerators gather at full bandwidth without it."""
    big_table = table.size * table.dtype.itemsize >= TOUCH_MIN_TABLE_BYTES
    if table.dtype.itemsize != 4 or not big_table:
        return 0
    return TOUCH_CHUNK_ROWS if num_ids >= 2 * TOUCH_CHUNK_ROWS else 0


@dataclasses.dataclass(frozen=True)
class _Choice:
    """What one platform's branch runs (hashable, as part of the custom_vjp's _Plan)."""

    impl: str  # xla | pallas_tpu | pallas_gpu | reference | error
    interpret: bool = False
    touch_chunk: int = 0  # xla impl: CPU touch-gather chunk, 0 = one flat gather
    error: str = ""  # impl "error": the ValueError raised when this branch is lowered


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static choices of one call (a nondiff argument of the custom_vjp)."""

    heads: int
    out_dtype: Any
    block_tokens: int | None
    cpu: _Choice
    cuda: _Choice
    tpu: _Choice


def _run(plan: _Plan, choice: _Choice, table_RxE, ids_M, row_scale_R) -> jax.Array:
    """One platform's branch: ``[M]`` flat ids (token-major, head-minor) -> ``[M // H, H*E]``."""
    ids_NxH = ids_M.reshape(-1, plan.heads)
    out_shape = (ids_NxH.shape[0], plan.heads * table_RxE.shape[1])
    if choice.impl == "error":
        return unsupported(choice.error, [jax.ShapeDtypeStruct(out_shape, plan.out_dtype)])[0]
    kwargs = dict(out_dtype=plan.out_dtype, interpret=choice.interpret)
    if plan.block_tokens is not None:
        kwargs["block_tokens"] = plan.block_tokens
    if choice.impl == "pallas_tpu":
        return _kernel.engram_lookup_dma(table_RxE, ids_NxH, row_scale_R, **kwargs)
    if choice.impl == "pallas_gpu":
        return _kernel.engram_lookup_vector(table_RxE, ids_NxH, row_scale_R, **kwargs)
    if choice.impl == "reference":
        return engram_lookup_reference(table_RxE, ids_NxH, row_scale_R, plan.out_dtype)
    out_MxE = _lookup_xla(table_RxE, ids_M, row_scale_R, plan.out_dtype, choice.touch_chunk)
    return out_MxE.reshape(out_shape)


def _forward(plan: _Plan, table_RxE, ids_M, row_scale_R) -> jax.Array:
    branch = lambda choice: functools.partial(_run, plan, choice)  # noqa: E731
    return by_platform(
        (table_RxE, ids_M, row_scale_R),
        cpu=branch(plan.cpu),
        cuda=branch(plan.cuda),
        tpu=branch(plan.tpu),
    )


_lookup = jax.custom_vjp(_forward, nondiff_argnums=(0,))


def _lookup_fwd(plan, table_RxE, ids_M, row_scale_R):
    # The residuals are the inputs themselves (no copies): the backward re-gathers rows
    # only when it needs them for the scale gradient.
    return _forward(plan, table_RxE, ids_M, row_scale_R), (table_RxE, ids_M, row_scale_R)


def _lookup_bwd(plan, residuals, g_NxHE):
    table_RxE, ids_M, row_scale_R = residuals
    num_rows, emb = table_RxE.shape
    g_MxE = g_NxHE.reshape(-1, emb).astype(jnp.float32)
    d_scale = None
    if row_scale_R is not None:
        rows_MxE = _gather_rows(table_RxE, ids_M).astype(jnp.float32)
        d_scale_M = jnp.sum(g_MxE * rows_MxE, axis=-1)
        d_scale = jnp.zeros((num_rows,), jnp.float32).at[ids_M].add(d_scale_M)
        d_scale = d_scale.astype(row_scale_R.dtype)
        g_MxE = g_MxE * row_scale_R.at[ids_M].get(mode="promise_in_bounds")[:, None]
    if table_RxE.dtype.itemsize == 1:
        d_table = jnp.zeros_like(table_RxE)  # FP8 storage format: see the module docstring
    else:
        d_table = jnp.zeros((num_rows, emb), jnp.float32).at[ids_M].add(g_MxE)
        d_table = d_table.astype(table_RxE.dtype)
    d_ids = np.zeros(ids_M.shape, dtype=jax.dtypes.float0)
    return d_table, d_ids, d_scale


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _validate(table, ids, row_scale, out_dtype, block_tokens) -> None:
    if table.ndim != 2:
        raise ValueError(f"engram_lookup: table must be 2-D [R, E], got shape {table.shape}")
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"engram_lookup: table must be floating point, got dtype {table.dtype}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"engram_lookup: ids must be an integer array, got dtype {ids.dtype}")
    if ids.ndim < 1 or ids.shape[-1] < 1:
        raise ValueError(
            f"engram_lookup: ids must have shape [..., H] with H >= 1, got {ids.shape}"
        )
    if row_scale is not None:
        if row_scale.shape != (table.shape[0],):
            raise ValueError(
                f"engram_lookup: row_scale must have shape [R] = ({table.shape[0]},), "
                f"got {row_scale.shape}"
            )
        if row_scale.dtype != jnp.float32:
            raise ValueError(f"engram_lookup: row_scale must be float32, got {row_scale.dtype}")
    if block_tokens is not None and (not isinstance(block_tokens, int) or block_tokens < 1):
        raise ValueError(
            f"engram_lookup: block_tokens must be a positive int, got {block_tokens!r}"
        )
    if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"engram_lookup: out_dtype must be floating point, got {out_dtype}")


def _pallas_shape_error(kind: str, table, block_tokens: int | None, heads: int, scaled) -> str:
    """Why the compiled ``kind`` kernel cannot take these shapes ("" if it can)."""
    emb = table.shape[1]
    if kind == "pallas_gpu":
        bt = block_tokens or 32
        if emb & (emb - 1) or bt & (bt - 1):
            return (
                f"the GPU (Triton) kernel needs power-of-two E and block_tokens, got "
                f"E={emb}, block_tokens={bt}"
            )
        if bt * emb > TRITON_MAX_NUMEL:
            return (
                f"the GPU (Triton) kernel loads (block_tokens, E) = ({bt}, {emb}) tiles, over "
                f"Triton's {TRITON_MAX_NUMEL} elements per tensor"
            )
    if kind == "pallas_tpu":
        bt = block_tokens or 8
        if table.dtype.itemsize not in (1, 2, 4):
            return f"the TPU kernel takes 8, 16 or 32-bit tables, got {table.dtype}"
        if (bt * heads) % 8:
            return (
                f"the TPU kernel needs block_tokens*H to be a multiple of 8 (sublane tiling), "
                f"got block_tokens={bt}, H={heads}"
            )
        vmem = _kernel.dma_vmem_bytes(bt * heads, emb, table.dtype, jnp.float32, scaled)
        if vmem > TPU_MAX_VMEM:
            return (
                f"the TPU kernel's blocks of block_tokens*H = {bt * heads} rows of E={emb} need "
                f"{vmem >> 20} MiB of VMEM, over its {TPU_MAX_VMEM >> 20} MiB limit"
            )
    return ""


_KERNEL_OF = {"cpu": None, "cuda": "pallas_gpu", "tpu": "pallas_tpu"}
_COMPILES_ON = {"pallas_tpu": "TPU", "pallas_gpu": "GPU (cuda/rocm)"}


def _choose(impl, interpret, table, block_tokens, heads, num_ids, scaled) -> dict:
    """{platform: _Choice} for ``impl`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"engram_lookup: impl must be one of {IMPLS}, got {impl!r}")
    reason = lambda kind: _pallas_shape_error(kind, table, block_tokens, heads, scaled)  # noqa: E731
    if impl in ("pallas_tpu", "pallas_gpu") and not interpret and reason(impl):
        raise ValueError(f"engram_lookup: {reason(impl)}; use impl='xla' for this shape")
    choices = {}
    for platform, native in _KERNEL_OF.items():
        if impl in ("xla", "reference") or (impl == "auto" and native is None):
            touch = _touch_chunk(table, num_ids) if platform == "cpu" and impl != "reference" else 0
            choices[platform] = _Choice(impl if impl == "reference" else "xla", touch_chunk=touch)
            continue
        if impl == "auto":
            choices[platform] = _Choice("xla" if reason(native) else native)
            continue
        kind = (native or "pallas_tpu") if impl == "pallas" else impl
        if interpret:
            choices[platform] = _Choice(kind, interpret=True)
        elif kind != native:
            where = (
                f"has no compiled kernel for {platform!r}"
                if impl == "pallas"
                else f"compiles only for {_COMPILES_ON[kind]}, this program is lowered for "
                f"{platform!r}"
            )
            msg = (
                f"engram_lookup: impl={impl!r} {where}; pass interpret=True to run it in the "
                "Pallas interpreter, or use impl='xla'"
            )
            choices[platform] = _Choice("error", error=msg)
        elif reason(kind):
            msg = f"engram_lookup (lowered for {platform!r}): {reason(kind)}; use impl='xla'"
            choices[platform] = _Choice("error", error=msg)
        else:
            choices[platform] = _Choice(kind)
    return choices


def engram_lookup(
    table: jax.Array,
    ids: jax.Array,
    row_scale: jax.Array | None = None,
    *,
    impl: str = "auto",
    interpret: bool = False,
    out_dtype=jnp.float32,
    block_tokens: int | None = None,
) -> jax.Array:
    """Concatenated Engram memory vectors ``[..., H*E]``.

    Args:
      table: ``[R, E]`` flat table of one layer (float32, bfloat16 or float8_e4m3fn).
      ids: ``[..., H]`` integer row ids, head offsets already added; each in ``[0, R)``
        (not checked under jit; see ``check_ids``).
      row_scale: optional ``[R]`` float32 per-row scale: ``row = table[r].astype(f32) * s[r]``.
      impl: "auto" | "xla" | "pallas" | "pallas_tpu" | "pallas_gpu" | "reference"; chosen
        per lowering platform (module docstring).
      interpret: run a Pallas impl in the Pallas interpreter (CPU tests).
      out_dtype: dtype of the result (dequantisation itself is in float32).
      block_tokens: tokens per Pallas grid step (kernel default when None).

    Returns ``out[..., h*E:(h+1)*E] = table[ids[..., h]] * s[ids[..., h]]``.
    """
    table, ids = jnp.asarray(table), jnp.asarray(ids)
    row_scale = None if row_scale is None else jnp.asarray(row_scale)
    _validate(table, ids, row_scale, out_dtype, block_tokens)
    heads, emb = ids.shape[-1], table.shape[1]
    choices = _choose(impl, interpret, table, block_tokens, heads, ids.size, row_scale is not None)
    plan = _Plan(heads, jnp.dtype(out_dtype), block_tokens, **choices)
    lead = ids.shape[:-1]
    if ids.size == 0:
        return jnp.zeros((*lead, heads * emb), out_dtype)
    out = _lookup(plan, table, ids.reshape(-1).astype(jnp.int32), row_scale)
    return out.reshape(*lead, heads * emb)


def check_ids(ids: Any, num_rows: int) -> None:
    """Host-side range check: raises ValueError naming the first id outside ``[0, num_rows)``."""
    ids_np = np.asarray(ids)
    if not np.issubdtype(ids_np.dtype, np.integer):
        raise ValueError(f"check_ids: ids must be integers, got dtype {ids_np.dtype}")
    bad = np.flatnonzero((ids_np < 0) | (ids_np >= num_rows))
    if bad.size:
        where = np.unravel_index(bad[0], ids_np.shape)
        raise ValueError(
            f"check_ids: id {int(ids_np[where])} at index {tuple(int(i) for i in where)} is "
            f"outside [0, {num_rows}) ({bad.size} bad ids in all)"
        )
