"""Pallas kernels of speculative verification: one pass over the draft and target rows.

Equation (``reference.py``; Leviathan et al. 2023), float32 whatever the input dtype::

    accept d_j  iff  j < L  and  u_j q_j(d_j) < p_j(d_j)        A = leading acceptances
    token = argmin_v E_v / r_v,  E_v = -log1p(-w_v),  r = max(0, p_A - q_A) if A < L and
            that residual has mass, else r = p_A
    out_tokens = (d_0 .. d_{A-1}, token, -1 ...)  [B, K+1],   num_accepted = A  [B]

A cannot be known before p_j(d_j) and q_j(d_j) are, and those sit anywhere in the row, so
instead of a second pass the kernels run every candidate race at once while streaming the
vocabulary: for each row j they keep p_j(d_j), q_j(d_j), the running (min, argmin) of the
residual race (j < K) and of the plain p race (j <= K), and the running max of the residual
(its "has mass" flag). The last vocabulary block then picks the row A winner. Traffic is one
read of p [B, K+1, V], q [B, K, V] and w [B, V]; the races cost 2K+1 divides per column.

Ties: the argmin is the first index, as ``jnp.argmin``: within a block the smallest column
holding the block minimum, across blocks a later block wins only if strictly smaller.
Columns >= ``vocab_size`` (the ragged last block, or a caller's padding) get r = 0, so their
key is +inf and no id >= vocab_size is ever emitted. Draft ids must lie in [0, vocab_size).

Two kernels, both run in interpret mode on CPU in the tests:

``spec_verify_blocked`` (TPU / Mosaic; the interpret-mode kernel). Grid ``(B, ceil(V / bv))``
with the vocabulary axis "arbitrary": step (b, i) gets blocks p[b, :, i] [K+1, bv],
q[b, :, i] [K, bv] and w[b, i] [1, bv] through the pipeline and folds them into VMEM
scratch columns ([K+1, 1] / [K, 1]); the step i = last writes the outputs. Per-row ids,
L and u come as [K, 1] / [1, 1] blocks (every block's last two dims equal the array's, as
Mosaic requires for dims that are not multiples of (8, 128)).

``spec_verify_rowloop`` (GPU / Triton). Triton has no scratch and runs the grid in parallel,
so grid ``(B,)`` and each program loops over the vocabulary itself, loading one [bv] slice
per row with a mask past V (bv a power of two, as every Triton tensor must be) and carrying
the per-row state as scalars; ids, L and u are scalar loads.

Verified here in interpret mode (CPU) against the reference; the compiled kernels are
lowered for TPU and CUDA at B = 128, K = 7, V = 129,280 in
``tests/kernels/test_lowering_spec_verify.py`` (Mosaic MLIR, Triton IR) but have not yet
run on their hardware. ``check_block_v`` holds each compiled kernel's limits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from v41jax.kernels.platforms import tpu_vmem_limit
from v41jax.kernels.spec_verify.limits import blocked_vmem_bytes, check_block_v, verify_cost

_NO_INDEX = 2**31 - 1  # larger than any column: loses every min over column indices


# --------------------------------------------------------------------------------------
# Shared math: any [..., bv] rows (a [R, bv] stack on TPU, one [bv] row on GPU).
# --------------------------------------------------------------------------------------


def _reduce(fn, x):
    """Reduction over the vocabulary (last) axis; keeps a [R, 1] column for stacked rows."""
    return fn(x, axis=-1, keepdims=x.ndim > 1)


def race_keys(r, e):
    """E / r where r > 0, +inf elsewhere: ``reference.race_keys`` with E precomputed once per
    block (the same two selects and one divide, so interpret mode is bit-identical)."""
    safe = jnp.where(r > 0, r, 1.0)
    return jnp.where(r > 0, e / safe, jnp.inf)


def _fold_min(keys, cols, run_min, run_idx):
    """(min, first argmin) of the race so far, updated with one block of keys."""
    block_min = _reduce(jnp.min, keys)
    block_idx = _reduce(jnp.min, jnp.where(keys == block_min, cols, _NO_INDEX))
    # Strict <: on a tie the earlier block (smaller column) keeps the win, as jnp.argmin.
    better = block_min < run_min
    return jnp.where(better, block_min, run_min), jnp.where(better, block_idx, run_idx)


def _fold_draft(p, q, d, cols, e, state):
    """Folds one block of draft rows j < K into (p_j(d_j), q_j(d_j), residual race, max r).

    p, q: float32 [..., bv], zero past V; q None = one-hot at d (a greedy/one-hot draft).
    """
    pd, qd, rmin, ridx, rmax = state
    hit = cols == d
    # Exactly one column of the whole row hits, so these sums are the exact entries.
    pd = pd + _reduce(jnp.sum, jnp.where(hit, p, 0.0))
    if q is None:
        q = jnp.where(hit, 1.0, 0.0)  # the reference's one_hot, as float32
    else:
        qd = qd + _reduce(jnp.sum, jnp.where(hit, q, 0.0))
    r = jnp.maximum(p - q, 0.0)
    rmax = jnp.maximum(rmax, _reduce(jnp.max, r))
    rmin, ridx = _fold_min(race_keys(r, e), cols, rmin, ridx)
    return pd, qd, rmin, ridx, rmax


def _finalize(k, d, u, length, pd, qd, rmax, ridx, pidx):
    """(A, out_tokens as K+1 values) from per-row lists (scalars or [1, 1] arrays).

    qd None means one-hot drafts (q_j(d_j) = 1).
    """
    num = alive = None
    for j in range(k):
        uq = u[j] if qd is None else u[j] * qd[j]
        ok = (uq < pd[j]) & (j < length)
        alive = ok if alive is None else alive & ok
        num = alive.astype(jnp.int32) if num is None else num + alive.astype(jnp.int32)
    # Pick row A's winners by selects over the (static, small) rows.
    p_tok = pidx[k]
    res_tok, res_mass = ridx[0], (num == 0) & (rmax[0] > 0)
    for j in range(k):
        p_tok = jnp.where(num == j, pidx[j], p_tok)
        if j:
            res_tok = jnp.where(num == j, ridx[j], res_tok)
            res_mass = res_mass | ((num == j) & (rmax[j] > 0))
    # A < L: first rejection, sample the residual unless it has no mass (only when
    # q_A(d_A) = 0 and p_A <= q_A); A = L (or A = K < L): the bonus/fallback p race.
    tok = jnp.where((num < length) & res_mass, res_tok, p_tok)
    out = [jnp.where(j < num, d[j], jnp.where(j == num, tok, -1)) for j in range(k)]
    out.append(jnp.where(num == k, tok, -1))
    return num, out


# --------------------------------------------------------------------------------------
# TPU (and interpret mode): grid (B, vocab blocks), state in VMEM scratch.
# --------------------------------------------------------------------------------------


def _blocked_kernel(*refs, k: int, vocab: int, block_v: int, has_q: bool):
    d_ref, u_ref, len_ref, p_ref, *rest = refs
    q_ref = rest.pop(0) if has_q else None
    w_ref, out_ref, num_ref, *scratch = rest
    pmin_ref, pidx_ref, pd_ref, qd_ref, rmin_ref, ridx_ref, rmax_ref = scratch
    step, last = pl.program_id(1), pl.num_programs(1) - 1

    @pl.when(step == 0)
    def _():
        for ref, val in [(pmin_ref, jnp.inf), (rmin_ref, jnp.inf), (pidx_ref, 0)]:
            ref[...] = jnp.full(ref.shape, val, ref.dtype)
        for ref in (ridx_ref, pd_ref, qd_ref, rmax_ref):
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    cols = step * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    valid = cols < vocab
    # The ragged last block holds unspecified values past V: zero them before any use.
    load = lambda block: jnp.where(valid, block.astype(jnp.float32), 0.0)
    e = -jnp.log1p(-w_ref[...].astype(jnp.float32))  # [1, bv]
    p = load(p_ref[...])  # [K+1, bv]
    pmin_ref[...], pidx_ref[...] = _fold_min(race_keys(p, e), cols, pmin_ref[...], pidx_ref[...])
    state = (pd_ref[...], qd_ref[...], rmin_ref[...], ridx_ref[...], rmax_ref[...])
    q = load(q_ref[...]) if has_q else None  # [K, bv]
    # Draft rows re-read from VMEM (an aligned ref slice) rather than a sublane value slice.
    state = _fold_draft(load(p_ref[:k, :]), q, d_ref[...], cols, e, state)
    pd_ref[...], qd_ref[...], rmin_ref[...], ridx_ref[...], rmax_ref[...] = state

    @pl.when(step == last)
    def _():
        rows = lambda ref, n: [ref[j : j + 1, :] for j in range(n)]  # [1, 1] each
        num, out = _finalize(
            k,
            rows(d_ref, k),
            rows(u_ref, k),
            len_ref[...],
            rows(pd_ref, k),
            rows(qd_ref, k) if has_q else None,
            rows(rmax_ref, k),
            rows(ridx_ref, k),
            rows(pidx_ref, k + 1),
        )
        for j in range(k + 1):
            out_ref[j : j + 1, :] = out[j]
        num_ref[...] = num


@functools.partial(jax.jit, static_argnames=("vocab_size", "block_v", "interpret"))
def spec_verify_blocked(
    draft_tokens_BxK: jax.Array,
    draft_probs_BxKxV: jax.Array | None,
    target_probs_BxK1xV: jax.Array,
    verify_len_B: jax.Array,
    accept_u_BxK: jax.Array,
    race_u_BxV: jax.Array,
    *,
    vocab_size: int,
    block_v: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """TPU kernel -> (out_tokens int32 [B, K+1], num_accepted int32 [B]); needs K >= 1.

    Columns >= ``vocab_size`` (<= the arrays' V) are ignored. ``block_v``: a multiple of
    128 or >= V on TPU (any positive int interpreted); the last block may be ragged.
    """
    b, k = draft_tokens_BxK.shape
    width = target_probs_BxK1xV.shape[-1]
    has_q = draft_probs_BxKxV is not None
    itemsize = max(a.dtype.itemsize for a in (target_probs_BxK1xV, race_u_BxV))
    if not interpret:
        check_block_v("blocked", block_v, width, k, itemsize, has_q)
    bv = min(block_v, width)  # one block equal to the whole row when it is short
    vmem_limit = tpu_vmem_limit(blocked_vmem_bytes(k, bv, itemsize, has_q))
    cost = verify_cost(b, k, width, (target_probs_BxK1xV, draft_probs_BxKxV, race_u_BxV))
    row = lambda *tail: pl.BlockSpec((None, *tail), lambda i, s: (i, 0, 0))
    vocab = lambda rows: pl.BlockSpec((None, rows, bv), lambda i, s: (i, 0, s))
    operands = [
        draft_tokens_BxK.astype(jnp.int32).reshape(b, k, 1),
        accept_u_BxK.astype(jnp.float32).reshape(b, k, 1),  # exact; the reference casts too
        verify_len_B.astype(jnp.int32).reshape(b, 1, 1),
        target_probs_BxK1xV,
    ]
    in_specs = [row(k, 1), row(k, 1), row(1, 1), vocab(k + 1)]
    if has_q:
        operands.append(draft_probs_BxKxV)
        in_specs.append(vocab(k))
    operands.append(race_u_BxV.reshape(b, 1, width))
    in_specs.append(vocab(1))
    f32, i32 = lambda n: pltpu.VMEM((n, 1), jnp.float32), lambda n: pltpu.VMEM((n, 1), jnp.int32)
    kernel = functools.partial(_blocked_kernel, k=k, vocab=int(vocab_size), block_v=bv, has_q=has_q)
    out, num = pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(width, bv)),
        in_specs=in_specs,
        out_specs=[row(k + 1, 1), row(1, 1)],
        out_shape=[
            jax.ShapeDtypeStruct((b, k + 1, 1), jnp.int32),
            jax.ShapeDtypeStruct((b, 1, 1), jnp.int32),
        ],
        # pmin, pidx [K+1]; p(d), q(d), rmin, ridx, rmax [K]
        scratch_shapes=[f32(k + 1), i32(k + 1), f32(k), f32(k), f32(k), i32(k), f32(k)],
        # The vocabulary axis is a reduction carried in scratch, so it must run in order.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit
        ),
        cost_estimate=cost,
        interpret=interpret,
    )(*operands)
    return out.reshape(b, k + 1), num.reshape(b)


# --------------------------------------------------------------------------------------
# GPU (Triton): grid (B,), each program loops over the vocabulary, state in registers.
# --------------------------------------------------------------------------------------


def _rowloop_kernel(*refs, k: int, vocab: int, block_v: int, has_q: bool):
    d_ref, u_ref, len_ref, p_ref, *rest = refs
    q_ref = rest.pop(0) if has_q else None
    w_ref, out_ref, num_ref = rest
    d = [d_ref[j] for j in range(k)]

    def body(i, carry):
        pmin, pidx, drafts = carry
        start = i * block_v
        cols = start + lax.broadcasted_iota(jnp.int32, (block_v,), 0)
        valid = cols < vocab

        def load(ref, *row):
            # Masked past V: the slice may run off the row end (other=0 gives r = 0 there).
            sl = ref.at[(*row, pl.ds(start, block_v))]
            return pltriton.load(sl, mask=valid, other=0.0).astype(jnp.float32)

        e = -jnp.log1p(-load(w_ref))
        pmin, pidx = list(pmin), list(pidx)
        drafts = list(drafts)
        for j in range(k + 1):
            p = load(p_ref, jnp.int32(j))
            pmin[j], pidx[j] = _fold_min(race_keys(p, e), cols, pmin[j], pidx[j])
            if j < k:
                q = load(q_ref, jnp.int32(j)) if has_q else None
                drafts[j] = _fold_draft(p, q, d[j], cols, e, drafts[j])
        return tuple(pmin), tuple(pidx), tuple(drafts)

    inf, zero_f, zero_i = jnp.float32(jnp.inf), jnp.float32(0), jnp.int32(0)
    init = (
        (inf,) * (k + 1),
        (zero_i,) * (k + 1),
        ((zero_f, zero_f, inf, zero_i, zero_f),) * k,
    )
    _, pidx, drafts = lax.fori_loop(0, pl.cdiv(vocab, block_v), body, init)
    pd, qd, _, ridx, rmax = (list(x) for x in zip(*drafts, strict=True))
    u = [u_ref[j] for j in range(k)]
    num, out = _finalize(k, d, u, len_ref[0], pd, qd if has_q else None, rmax, ridx, pidx)
    for j in range(k + 1):
        out_ref[j] = out[j]
    num_ref[0] = num


@functools.partial(jax.jit, static_argnames=("vocab_size", "block_v", "interpret", "num_warps"))
def spec_verify_rowloop(
    draft_tokens_BxK: jax.Array,
    draft_probs_BxKxV: jax.Array | None,
    target_probs_BxK1xV: jax.Array,
    verify_len_B: jax.Array,
    accept_u_BxK: jax.Array,
    race_u_BxV: jax.Array,
    *,
    vocab_size: int,
    block_v: int,
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """GPU kernel -> (out_tokens int32 [B, K+1], num_accepted int32 [B]); needs K >= 1.

    Columns >= ``vocab_size`` (<= the arrays' V) are ignored. ``block_v``: a power of two
    (Triton tensor sizes), any size relative to V (loads past V are masked).
    """
    b, k = draft_tokens_BxK.shape
    width = target_probs_BxK1xV.shape[-1]
    has_q = draft_probs_BxKxV is not None
    if not interpret:
        check_block_v("rowloop", block_v, int(vocab_size))
    cost = verify_cost(b, k, width, (target_probs_BxK1xV, draft_probs_BxKxV, race_u_BxV))
    # On GPU a block is a base pointer: whole rows, of which the kernel loads [bv] slices.
    row = lambda *tail: pl.BlockSpec((None, *tail), lambda i: (i,) + (0,) * len(tail))
    operands = [
        draft_tokens_BxK.astype(jnp.int32),
        accept_u_BxK.astype(jnp.float32),
        verify_len_B.astype(jnp.int32).reshape(b, 1),
        target_probs_BxK1xV,
    ]
    in_specs = [row(k), row(k), row(1), row(k + 1, width)]
    if has_q:
        operands.append(draft_probs_BxKxV)
        in_specs.append(row(k, width))
    operands.append(race_u_BxV)
    in_specs.append(row(width))
    kernel = functools.partial(
        _rowloop_kernel, k=k, vocab=int(vocab_size), block_v=block_v, has_q=has_q
    )
    out, num = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=in_specs,
        out_specs=[row(k + 1), row(1)],
        out_shape=[
            jax.ShapeDtypeStruct((b, k + 1), jnp.int32),
            jax.ShapeDtypeStruct((b, 1), jnp.int32),
        ],
        # Explicit Triton params select the Triton lowering (the default is Mosaic GPU).
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        cost_estimate=cost,
        interpret=interpret,
    )(*operands)
    return out, num.reshape(b)
