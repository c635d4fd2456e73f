"""Pallas kernels for the Engram lookup: gather H rows per token, dequantise, concatenate.

Equation (``reference.py``): for token t with flat-table row ids ``ids[t, h]``
(head offsets already added) and an optional per-row FP8 scale ``s``::

    out[t, h*E:(h+1)*E] = table[ids[t, h]].astype(f32) * s[ids[t, h]]        (h = 0..H-1)

Two kernels, one per compiled backend, both run in interpret mode on CPU in the tests:

``engram_lookup_dma`` (TPU / Mosaic). The flat ids ``[N*H]`` (and their gathered scales)
go to SMEM by scalar prefetch; the table stays in HBM (``pl.ANY``) and every row is
fetched by its own manual DMA whose source offset is the id read from SMEM: a 32-bit row
alone, a 16/8-bit row with the aligned group of 16/32 rows that shares its tiles
(``rows_per_dma``: Mosaic refuses a packed row at an arbitrary offset), the row then picked
out in VMEM. Grid ``(ceil(N / bt),)``: step ``b`` owns tokens ``[b*bt, (b+1)*bt)``, i.e.
``bt*H`` consecutive flat rows, and writes output block ``(bt*H, E)`` of the ``[N*H, E]``
result (a free reshape of ``[N, H*E]``, so the heads land concatenated). Two VMEM slots
double-buffer across steps: step ``b`` starts the ``bt*H`` copies of block ``b+1`` into
the other slot, then waits for its own (started by step ``b-1``, or by itself at
``b == 0``), dequantises the slot and stores it. All copies of a block are in flight
together, which is what hides HBM latency for tiny rows. Compiled for TPU v4/v5e/v5p/v6e
from a CPU host in ``tests/aot/test_aot_engram.py``.

``engram_lookup_vector`` (GPU / Triton). Triton has no scalar prefetch, but its loads
take integer-array indices, so the gather is a vector load. Grid ``(ceil(N / bt),)``: step
``b`` loads its ids block ``(bt, H)`` and, for each head ``h`` (static loop), loads the
``(bt, E)`` rows ``table[ids[:, h]]`` (and ``(bt,)`` scales) straight from global memory
and stores them into columns ``[h*E, (h+1)*E)`` of output block ``(bt, H*E)``. FP8 tables
are read as ``uint16`` pairs ``[R, E/2]`` and decoded in the kernel (``decode_e4m3``): the
Triton lowering indexes arrays of up to 4 GiB with signed 32-bit element offsets, which
wrap past 2^31 elements, i.e. for a 1-byte table of 2-4 GiB (the 2^24 x 256 FP8 table is
exactly 4 GiB); in 2-byte units the largest offset is 2^31 - 1.

Both pad the token count up to a multiple of ``bt`` with id 0 (a valid row) and slice
the padding off, so any N works. Verified here in interpret mode (the TPU
interpreter also checks semaphore balance and races), lowered and compiled for TPU and
CUDA at full scale (``tests/kernels/test_lowering_engram_lookup.py``, ``tests/aot``);
the compiled twins in the tests run only on their hardware. Ids are not range-checked:
an out-of-range id is undefined behaviour (a DMA/load outside the table); see
``api.check_ids``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from v41jax.kernels.platforms import TPU_MAX_VMEM, tpu_vmem_bytes, tpu_vmem_limit

# Ids per pallas_call of the DMA kernel: they (and their scales) sit in SMEM, 4 bytes each,
# which holds well under 1 MiB on current TPUs; longer id lists are split into calls.
MAX_IDS_PER_DMA_CALL = 1 << 15


def rows_per_dma(dtype) -> int:
    """Table rows one DMA of the TPU kernel fetches: the row's aligned group of rows.

    Why: in HBM and VMEM a TPU stores 16-bit rows in pairs and 8-bit rows in fours inside
    each 32-bit sublane word (tiles of (8 * packing, 128), e.g. bf16 ``(8,128)(2,1)``), so a
    DMA of one such row at an arbitrary offset slices inside a tile and Mosaic refuses it
    ("Offsets along tiled dimensions must be aligned to tiles"). A 32-bit row is one
    sublane: 1. A 16-bit row: the 16 rows (8 sublanes x 2, the largest bf16 tile) around
    it; an 8-bit row: 32. The kernel then picks the row out of its group in VMEM. Cost: 16
    / 32x the row's bytes read (its bytes share every word with the group's: no DMA reads
    fewer); a table stored as 32-bit words per row would need one sublane per row.
    """
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"engram_lookup_dma: tables of 8, 16 or 32-bit rows, got {dtype}")
    return 32 // itemsize if itemsize < 4 else 1


def dma_vmem_bytes(rows_per_block: int, emb: int, dtype, out_dtype, has_scale: bool) -> int:
    """VMEM of one ``engram_lookup_dma`` call: two slots of ``rows_per_block`` 32-bit rows,
    or of as many row groups ``[G, E]`` (``G = rows_per_dma``, each its own tile); the f32
    block assembled from them; the double-buffered output block and table tail ``[G, E]``.
    ``has_scale`` adds none: the scales ride in SMEM with the ids."""
    del has_scale
    group = rows_per_dma(dtype)
    if group == 1:  # 32-bit rows: one [rows_per_block, E] buffer per slot
        total = 2 * tpu_vmem_bytes(rows_per_block, emb, dtype)
    else:
        total = 2 * rows_per_block * tpu_vmem_bytes(group, emb, dtype)
    total += tpu_vmem_bytes(rows_per_block, emb, jnp.float32)
    total += 2 * tpu_vmem_bytes(rows_per_block, emb, out_dtype)
    if group > 1:
        total += 2 * tpu_vmem_bytes(group, emb, dtype)
    return total


def lookup_cost(
    num_ids: int, emb: int, dtype, out_dtype, has_scale: bool, rows_read: int = 1
) -> pl.CostEstimate:
    """XLA's view of one lookup call: bytes of the table rows read (``rows_read`` per id:
    the TPU kernel's whole row group), the output written, the ids (and scales) read; one
    multiply per element when dequantising."""
    elems = num_ids * emb
    nbytes = elems * (rows_read * jnp.dtype(dtype).itemsize + jnp.dtype(out_dtype).itemsize)
    nbytes += num_ids * 4 * (2 if has_scale else 1)
    return pl.CostEstimate(
        flops=elems if has_scale else 0, transcendentals=0, bytes_accessed=nbytes
    )


def _pad_tokens(ids_NxH: jax.Array, block_tokens: int) -> tuple[jax.Array, int]:
    """Pads the token axis with id 0 up to a multiple of ``block_tokens``; returns (ids, N)."""
    n = ids_NxH.shape[0]
    pad = -n % block_tokens
    if pad:
        ids_NxH = jnp.pad(ids_NxH, ((0, pad), (0, 0)))
    return ids_NxH, n


def _dequantise(rows: jax.Array, scale: jax.Array | None, out_dtype) -> jax.Array:
    """``rows.astype(f32) * scale`` (or a plain cast without scale), exactly as the reference."""
    if scale is None:
        return rows.astype(out_dtype)
    return (rows.astype(jnp.float32) * scale).astype(out_dtype)


# --------------------------------------------------------------------------------------
# TPU: scalar-prefetched ids drive one manual DMA per row group, double-buffered across steps.
# --------------------------------------------------------------------------------------


def _pick_row(group_GxE: jax.Array, k) -> jax.Array:
    """Row ``k`` (a scalar) of a ``[G, E]`` float32 group as ``[1, E]``, bit-exactly.

    Mosaic refuses a dynamic slice inside a packed tile, so a mask selects it: the other
    rows' bit patterns are zeroed and the ``G`` integers summed (NaN and -0.0 kept).
    """
    bits = lax.bitcast_convert_type(group_GxE, jnp.int32)
    rows = lax.broadcasted_iota(jnp.int32, bits.shape, 0)
    picked = jnp.sum(jnp.where(rows == k, bits, 0), axis=0, keepdims=True)
    return lax.bitcast_convert_type(picked, jnp.float32)


def _dma_kernel(ids_smem, *refs, rows_per_block, group, num_rows, has_scale, has_tail):
    scale_smem, refs = (refs[0], refs[1:]) if has_scale else (None, refs)
    table_hbm, refs = refs[0], refs[1:]
    tail_ref, refs = (refs[0], refs[1:]) if has_tail else (None, refs)
    out_ref, rows_buf, block_f32, sems = refs
    step, num_steps = pl.program_id(0), pl.num_programs(0)
    # Rows at or past `aligned_end` have no whole group in the table: they are read from
    # the tail block (the table's last `group` rows) and their DMA fetches group 0 instead.
    aligned_end = num_rows - num_rows % group

    def where_row(block, r):
        """(row id, start of the group DMA'd for it, row's index in group or tail)."""
        row = ids_smem[block * rows_per_block + r]
        if group == 1:
            return row, row, 0
        in_tail = row >= aligned_end
        start = jnp.where(in_tail, 0, row - row % group)
        k = jnp.where(in_tail, row - (num_rows - group), row % group)
        return row, pl.multiple_of(start, group), k

    def row_copy(block, slot, r):
        """The DMA that brings the group of flat row ``block*rows_per_block + r`` to ``slot``."""
        _, start, _ = where_row(block, r)
        dest = rows_buf.at[slot, pl.ds(r, 1)] if group == 1 else rows_buf.at[slot, r]
        return pltpu.make_async_copy(table_hbm.at[pl.ds(start, group)], dest, sems.at[slot])

    def each_copy(block, slot, action):
        # A wait consumes one copy's bytes on the slot's semaphore, so one wait per started
        # copy (same shapes) drains exactly what the starts signalled.
        def body(r, carry):
            getattr(row_copy(block, slot, r), action)()
            return carry

        lax.fori_loop(0, rows_per_block, body, 0)

    @pl.when(step == 0)
    def _():
        each_copy(0, 0, "start")

    @pl.when(step + 1 < num_steps)
    def _():
        each_copy(step + 1, (step + 1) % 2, "start")

    slot = step % 2
    each_copy(step, slot, "wait")

    def assemble(r, carry):
        row, _, k = where_row(step, r)
        source = rows_buf[slot, pl.ds(r, 1)] if group == 1 else rows_buf[slot, r]
        source = source.astype(jnp.float32)  # [group, E]
        if has_tail:
            source = jnp.where(row >= aligned_end, tail_ref[...].astype(jnp.float32), source)
        value = source if group == 1 else _pick_row(source, k)
        if has_scale:
            value = value * scale_smem[step * rows_per_block + r]
        block_f32[pl.ds(r, 1), :] = value
        return carry

    lax.fori_loop(0, rows_per_block, assemble, 0)
    out_ref[...] = block_f32[...].astype(out_ref.dtype)


def _dma_call(table_RxE, tail_GxE, ids_M, scale_M, *, rows_per_block, out_dtype, interpret):
    """One pallas_call over ``M`` flat ids (a multiple of ``rows_per_block``) -> ``[M, E]``.
    ``scale_M``: the ids' gathered row scales (or None); ``tail_GxE``: the table's last
    ``rows_per_dma`` rows when the row count is not a multiple of it (else None)."""
    (num_ids,) = ids_M.shape
    num_rows, emb = table_RxE.shape
    group = rows_per_dma(table_RxE.dtype)
    has_scale, has_tail = scale_M is not None, tail_GxE is not None
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)]
    if has_tail:
        in_specs.append(pl.BlockSpec((group, emb), lambda b, *_: (0, 0)))
    scratch = [
        # 32-bit rows are single sublanes: a [rows, E] slot; packed rows: one tile per group.
        pltpu.VMEM((2, rows_per_block, *((group,) if group > 1 else ()), emb), table_RxE.dtype),
        pltpu.VMEM((rows_per_block, emb), jnp.float32),
        pltpu.SemaphoreType.DMA((2,)),
    ]
    kernel = functools.partial(
        _dma_kernel,
        rows_per_block=rows_per_block,
        group=group,
        num_rows=num_rows,
        has_scale=has_scale,
        has_tail=has_tail,
    )
    vmem = dma_vmem_bytes(rows_per_block, emb, table_RxE.dtype, out_dtype, has_scale)
    if vmem > TPU_MAX_VMEM:
        raise ValueError(
            f"engram_lookup_dma: {rows_per_block} rows per block of E={emb} need {vmem >> 20} "
            f"MiB of VMEM, over the {TPU_MAX_VMEM >> 20} MiB limit; lower block_tokens"
        )
    limit = tpu_vmem_limit(vmem)  # more scoped VMEM only when the default is too small
    prefetch = (ids_M, scale_M) if has_scale else (ids_M,)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_ids // rows_per_block,),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((rows_per_block, emb), lambda b, *_: (b, 0)),
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((num_ids, emb), out_dtype),
        # Sequential grid: step b prefetches block b+1 into the slot step b+1 reads.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=limit
        ),
        cost_estimate=lookup_cost(num_ids, emb, table_RxE.dtype, out_dtype, has_scale, group),
        interpret=interpret,
    )(*prefetch, table_RxE, *([tail_GxE] if has_tail else []))


def engram_lookup_dma(
    table_RxE: jax.Array,
    ids_NxH: jax.Array,
    row_scale_R: jax.Array | None = None,
    *,
    block_tokens: int = 8,
    out_dtype=jnp.float32,
    interpret: bool = False,
    max_ids_per_call: int = MAX_IDS_PER_DMA_CALL,
) -> jax.Array:
    """TPU kernel: ``[R, E]`` table, ``[N, H]`` int ids, optional ``[R]`` scale -> ``[N, H*E]``.

    Block: ``block_tokens`` tokens = ``block_tokens*H`` rows per grid step (a multiple of 8
    on TPU, the sublane tiling of the output block). Ids beyond ``max_ids_per_call`` (SMEM
    size) are processed by further calls, each a whole number of blocks. The ids' scales
    are gathered by XLA (``N*H`` floats) and ride in SMEM beside the ids: a ``[R, 1]`` scale
    column in HBM would be padded to 128 lanes (a copy of 512 bytes per table row).
    """
    n_tokens, heads = ids_NxH.shape
    num_rows, emb = table_RxE.shape
    group = rows_per_dma(table_RxE.dtype)
    if num_rows < group:  # a tiny table: pad it to one whole group (a copy of < 32 rows)
        table_RxE = jnp.pad(table_RxE, ((0, group - num_rows), (0, 0)))
    tail_GxE = table_RxE[-group:] if table_RxE.shape[0] % group else None
    ids_NxH, n_tokens = _pad_tokens(ids_NxH, block_tokens)
    rows_per_block = block_tokens * heads
    ids_M = ids_NxH.reshape(-1).astype(jnp.int32)
    scale_M = None if row_scale_R is None else row_scale_R.at[ids_M].get(mode="clip")
    chunk = max(1, max_ids_per_call // rows_per_block) * rows_per_block
    outs = [
        _dma_call(
            table_RxE,
            tail_GxE,
            ids_M[start : start + chunk],
            None if scale_M is None else scale_M[start : start + chunk],
            rows_per_block=rows_per_block,
            out_dtype=out_dtype,
            interpret=interpret,
        )
        for start in range(0, ids_M.shape[0], chunk)
    ]
    out_MxE = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return out_MxE.reshape(-1, heads * emb)[:n_tokens]


# --------------------------------------------------------------------------------------
# GPU: vector gather loads (Triton lowering), one token block per program.
# --------------------------------------------------------------------------------------


def decode_e4m3(byte_u32: jax.Array) -> jax.Array:
    """float8_e4m3fn bit patterns (in the low byte of a uint32) -> float32, exactly.

    e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (m * 2^-9), S.1111.111 is NaN, there is no infinity. A normal value is re-biased into
    a float32 bit pattern (exponent + 120, mantissa shifted to the top of 23 bits).
    """
    exp, man = (byte_u32 >> 3) & 0xF, byte_u32 & 0x7
    normal = lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    mag = jnp.where(exp == 0, man.astype(jnp.float32) * (2.0**-9), normal)
    mag = jnp.where((exp == 15) & (man == 7), jnp.nan, mag)
    return jnp.where((byte_u32 & 0x80) != 0, -mag, mag)


def _vector_kernel(
    ids_ref, table_ref, *refs, heads: int, emb: int, has_scale: bool, fp8_pairs: bool, out_dtype
):
    scale_ref, out_ref = refs if has_scale else (None, refs[0])
    for h in range(heads):  # static: H is small and each head writes its own column range
        idx = ids_ref[:, h]  # [bt]
        scale = scale_ref[idx][:, None] if has_scale else None
        if not fp8_pairs:
            out_ref[:, h * emb : (h + 1) * emb] = _dequantise(table_ref[idx, :], scale, out_dtype)
            continue
        # uint16 j of a row holds FP8 elements 2j (low byte) and 2j+1 (high byte): decode
        # both and store them to the even / odd columns of the head's range.
        pairs = table_ref[idx, :].astype(jnp.uint32)  # [bt, E/2]
        for half, byte in ((0, pairs & 0xFF), (1, pairs >> 8)):
            cols = pl.ds(h * emb + half, emb // 2, stride=2)
            out_ref[:, cols] = _dequantise(decode_e4m3(byte), scale, out_dtype)


def engram_lookup_vector(
    table_RxE: jax.Array,
    ids_NxH: jax.Array,
    row_scale_R: jax.Array | None = None,
    *,
    block_tokens: int = 32,
    out_dtype=jnp.float32,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:
    """GPU kernel: ``[R, E]`` table, ``[N, H]`` int ids, optional ``[R]`` scale -> ``[N, H*E]``.

    Block: ``block_tokens`` tokens per program; each load/store is ``(block_tokens, E)``,
    which the Triton lowering needs to be a power of two in size. An FP8 table (even E)
    is passed as its ``uint16`` view ``[R, E/2]`` (free) and decoded in the kernel; odd E
    (interpreted, or tables under 2^31 elements) reads the bytes directly.
    """
    rows, emb = table_RxE.shape
    heads = ids_NxH.shape[1]
    ids_NxH, n_tokens = _pad_tokens(ids_NxH.astype(jnp.int32), block_tokens)
    has_scale = row_scale_R is not None
    cost = lookup_cost(ids_NxH.size, emb, table_RxE.dtype, out_dtype, has_scale)
    fp8 = table_RxE.dtype == jnp.float8_e4m3fn
    fp8_pairs = fp8 and emb % 2 == 0
    if fp8 and not fp8_pairs and not interpret and rows * emb > 2**31:
        raise ValueError(
            f"engram_lookup_vector: an FP8 table of over 2^31 elements needs an even E (read "
            f"as uint16 pairs for 32-bit offsets), got E={emb}, R={rows}"
        )
    if fp8_pairs:
        table_RxE = lax.bitcast_convert_type(table_RxE.reshape(rows, emb // 2, 2), jnp.uint16)
    # The table/scale "blocks" are the whole arrays: on GPU a block is only a base pointer,
    # the kernel's gather load reads just the rows it names.
    in_specs = [
        pl.BlockSpec((block_tokens, heads), lambda b: (b, 0)),
        pl.BlockSpec(table_RxE.shape, lambda b: (0, 0)),
    ]
    operands = [ids_NxH, table_RxE]
    if has_scale:
        in_specs.append(pl.BlockSpec((rows,), lambda b: (0,)))
        operands.append(row_scale_R)
    kernel = functools.partial(
        _vector_kernel,
        heads=heads,
        emb=emb,
        has_scale=has_scale,
        fp8_pairs=fp8_pairs,
        out_dtype=out_dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid=(ids_NxH.shape[0] // block_tokens,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_tokens, heads * emb), lambda b: (b, 0)),
        out_shape=jax.ShapeDtypeStruct((ids_NxH.shape[0], heads * emb), out_dtype),
        # Explicit Triton params: the default GPU lowering (Mosaic GPU) has no gather load.
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        cost_estimate=cost,
        interpret=interpret,
    )(*operands)
    return out[:n_tokens]
