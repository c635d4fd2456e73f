"""Blockwise (flash-style) attention in plain XLA: memory linear in T, forward and backward.

Online softmax over key blocks (Milakov & Gimelshein 2018; Dao et al., FlashAttention,
2022; FlashAttention-2, 2023): for each query block i, keys are visited one block j at a
time with running max m, normaliser l and unnormalised output acc, all float32:

    s = q_i k_j^T / sqrt(K),  m' = max(m, rowmax s),  p = exp(s - m'),
    l' = l e^(m - m') + rowsum p,  acc' = acc e^(m - m') + p v_j,   o_i = acc / l,
    lse_i = m + log l.

The backward pass (a `jax.custom_vjp`) saves only q, k, v, o and lse (O(T)) and recomputes
p = exp(s - lse) per block pair: with D = rowsum(dO o),

    dv_j += p^T dO_i,  ds = p (dO_i v_j^T - D),  dq_i += ds k_j / sqrt(K),
    dk_j += ds^T q_i / sqrt(K)

in one sweep (key blocks outside, query blocks inside, dq accumulated in place), so no
[T, S] array exists at any point and autodiff stores no T x S residual.

Visibility is computed per block pair from positions and segment ids (`AttentionLayout`
semantics): key s is visible to query t iff kv_pos[s] <= q_pos[t] and the segments match.
A block pair where no key can be visible to any query (the upper triangle of a causal
layout; disjoint segment ranges) is skipped with `lax.cond`; the test is on block-wise
min/max of positions and segment ids, so it never skips a visible key.

GQA: query heads are grouped [G, R] and each group's R x bq query rows meet one kv head's
keys in a single matmul; k/v are never repeated. T and S need not be block multiples: they
are padded inside and padded keys are invisible.

Rows that see no key at all (fully masked padding rows) give output 0, a zero gradient to
everything and no NaN. The masked reference (`reference.causal_attention`) averages all
keys uniformly there instead; the two agree on every row that sees at least one key.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Finite stand-in for -inf in the running max: exp(NEG - m) underflows to 0 for any real
# score and NEG - NEG = 0 never makes a NaN (a true -inf would give -inf - -inf).
NEG = -0.7 * float(np.finfo(np.float32).max)
INT_MIN, INT_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def block_split(n: int, block_size: int) -> tuple[int, int]:
    """(block, num_blocks) covering n with blocks of at most `block_size`, balanced so the
    padding is small (n = 600, block_size 512 gives 2 x 304, not 2 x 512); blocks are
    rounded up to a multiple of 8 (sublanes) when there is more than one."""
    nb = max(1, math.ceil(n / block_size))
    if nb == 1:
        return max(n, 1), 1
    bsz = min(block_size, -(-math.ceil(n / nb) // 8) * 8)
    return bsz, math.ceil(n / bsz)


def _pad_axis(x, axis: int, size: int, value):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _q_blocks(x_BxTxHxK, g: int, bq: int, nq: int):
    """[B, T, H, K] -> [nq, B, G, R * bq, K] (row r * bq + u is head g*R + r, token i*bq + u)."""
    b, t, h, k = x_BxTxHxK.shape
    x = _pad_axis(x_BxTxHxK, 1, nq * bq, 0).reshape(b, nq, bq, g, h // g, k)
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(nq, b, g, (h // g) * bq, k)


def _q_unblocks(x, t: int, r: int):
    """Inverse of `_q_blocks`: [nq, B, G, R * bq, K] -> [B, T, H, K]."""
    nq, b, g, rbq, k = x.shape
    bq = rbq // r
    x = x.reshape(nq, b, g, r, bq, k).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(b, nq * bq, g * r, k)[:, :t]


def _kv_blocks(x_BxSxGxK, bk: int, nk: int):
    """[B, S, G, K] -> [nk, B, G, bk, K]."""
    b, _, g, k = x_BxSxGxK.shape
    x = _pad_axis(x_BxSxGxK, 1, nk * bk, 0).reshape(b, nk, bk, g, k)
    return x.transpose(1, 0, 3, 2, 4)


def _kv_unblocks(x, s: int):
    nk, b, g, bk, k = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, g, k)[:, :s]


def _seq_blocks(x_BxN, nb: int, bsz: int, fill):
    """[B, N] int -> [nb, B, bsz] padded with `fill`."""
    b = x_BxN.shape[0]
    return _pad_axis(x_BxN, 1, nb * bsz, fill).reshape(b, nb, bsz).transpose(1, 0, 2)


class _Blocks:
    """Per-block layout of one call: positions, segments, key validity, and which block
    pairs can hold a visible key."""

    def __init__(self, q_pos, kv_pos, q_seg, kv_seg, t, s, bq, nq, bk, nk):
        self.q_pos = _seq_blocks(q_pos, nq, bq, INT_MIN)  # padded queries see nothing
        self.kv_pos = _seq_blocks(kv_pos, nk, bk, INT_MAX)
        # Padded keys are excluded by index, so even q_pos = INT_MAX cannot see them.
        self.kv_valid = jnp.asarray(np.arange(nk * bk).reshape(nk, bk) < s)
        q_valid = np.arange(nq * bq).reshape(nq, 1, bq) < t
        kv_valid = self.kv_valid[:, None, :]
        vis = self.kv_pos.min((1, 2))[None, :] <= self.q_pos.max((1, 2))[:, None]
        self.q_seg = self.kv_seg = None
        if q_seg is not None:
            self.q_seg = _seq_blocks(q_seg, nq, bq, 0)
            self.kv_seg = _seq_blocks(kv_seg, nk, bk, 0)
            qs_min = jnp.where(q_valid, self.q_seg, INT_MAX).min((1, 2))
            qs_max = jnp.where(q_valid, self.q_seg, INT_MIN).max((1, 2))
            ks_min = jnp.where(kv_valid, self.kv_seg, INT_MAX).min((1, 2))
            ks_max = jnp.where(kv_valid, self.kv_seg, INT_MIN).max((1, 2))
            vis &= (ks_min[None, :] <= qs_max[:, None]) & (ks_max[None, :] >= qs_min[:, None])
        self.visible = vis  # [nq, nk] bool
        self.skip = nq * nk > 1  # one block pair: nothing to skip, no cond

    def mask(self, i, j):
        """[B, 1, 1, bq, bk] visibility of block pair (i, j)."""
        m = self.kv_pos[j][:, None, :] <= self.q_pos[i][:, :, None]
        m &= self.kv_valid[j][None, None, :]
        if self.q_seg is not None:
            m &= self.q_seg[i][:, :, None] == self.kv_seg[j][:, None, :]
        return m[:, None, None]


def _when_visible(blocks: _Blocks, i, j, fn, skipped, *operands):
    """fn(*operands) if block pair (i, j) may hold a visible key, else `skipped`'s value."""
    if not blocks.skip:
        return fn(*operands)
    return jax.lax.cond(blocks.visible[i, j], fn, skipped, *operands)


def _scores(q_blk, k_blk, r: int, scale: float):
    """[B, G, R*bq, K] x [B, G, bk, K] -> float32 [B, G, R, bq, bk]."""
    s = jnp.einsum("bgmk,bgnk->bgmn", q_blk, k_blk, preferred_element_type=jnp.float32)
    b, g, rbq, bk = s.shape
    return (s * scale).reshape(b, g, r, rbq // r, bk)


def _forward(qb, kb, vb, blocks: _Blocks, r: int, scale: float):
    """Blocked forward: (o [nq, B, G, R*bq, K] in q's dtype, lse [nq, B, G, R, bq] f32)."""
    nq, b, g, rbq, kd = qb.shape
    nk, bq = kb.shape[0], rbq // r

    def q_block(i):
        q_blk = qb[i]

        def k_step(carry, j):
            def update(m, denom, acc):
                mask = blocks.mask(i, j)
                s = jnp.where(mask, _scores(q_blk, kb[j], r, scale), NEG)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bgmn,bgnk->bgmk",
                    p.reshape(b, g, rbq, -1).astype(vb.dtype),
                    vb[j],
                    preferred_element_type=jnp.float32,
                )
                acc = acc * alpha.reshape(b, g, rbq, 1) + pv
                return m_new, denom * alpha + p.sum(-1), acc

            return _when_visible(blocks, i, j, update, lambda *c: c, *carry), None

        init = (
            jnp.full((b, g, r, bq), NEG, jnp.float32),
            jnp.zeros((b, g, r, bq), jnp.float32),
            jnp.zeros((b, g, rbq, kd), jnp.float32),
        )
        (m, denom, acc), _ = jax.lax.scan(k_step, init, jnp.arange(nk))
        seen = denom > 0  # rows that see no key: o = 0, lse = 0 (never read: p is masked)
        l_safe = jnp.where(seen, denom, 1.0)
        o = jnp.where(seen.reshape(b, g, rbq, 1), acc / l_safe.reshape(b, g, rbq, 1), 0.0)
        lse = jnp.where(seen, m + jnp.log(l_safe), 0.0)
        return o.astype(qb.dtype), lse

    return jax.lax.map(q_block, jnp.arange(nq))


def _backward(qb, kb, vb, ob, lse, dob, blocks: _Blocks, r: int, scale: float):
    """(dq [nq, B, G, R*bq, K], dk, dv [nk, B, G, bk, K]) in float32, one sweep."""
    nq, b, g, rbq, kd = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]
    bq = rbq // r
    # D_t = sum_k dO_tk o_tk = sum_s p_ts dp_ts: the softmax backward's row term.
    dsum = jnp.einsum("ibgmk,ibgmk->ibgm", dob, ob, preferred_element_type=jnp.float32).reshape(
        nq, b, g, r, bq
    )

    def k_block(dq_acc, j):
        k_blk, v_blk = kb[j], vb[j]

        def q_step(carry, i):
            dk, dv, dq_acc = carry
            q_blk, do_blk = qb[i], dob[i]

            def grads(q_blk, do_blk):
                mask = blocks.mask(i, j)
                s = jnp.where(mask, _scores(q_blk, k_blk, r, scale), NEG)
                p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
                dp = jnp.einsum(
                    "bgmk,bgnk->bgmn", do_blk, v_blk, preferred_element_type=jnp.float32
                ).reshape(p.shape)
                ds = (p * (dp - dsum[i][..., None])).reshape(b, g, rbq, bk)
                p = p.reshape(b, g, rbq, bk)
                f32 = jnp.float32
                dv_c = jnp.einsum(
                    "bgmn,bgmk->bgnk", p.astype(do_blk.dtype), do_blk, preferred_element_type=f32
                )
                dk_c = jnp.einsum(
                    "bgmn,bgmk->bgnk", ds.astype(q_blk.dtype), q_blk, preferred_element_type=f32
                )
                dq_c = jnp.einsum(
                    "bgmn,bgnk->bgmk", ds.astype(k_blk.dtype), k_blk, preferred_element_type=f32
                )
                return dk_c * scale, dv_c, dq_c * scale

            def skipped(q_blk, do_blk):
                z = jnp.zeros((b, g, bk, kd), jnp.float32)
                return z, z, jnp.zeros((b, g, rbq, kd), jnp.float32)

            dk_c, dv_c, dq_c = _when_visible(blocks, i, j, grads, skipped, q_blk, do_blk)
            # Accumulate outside the cond: the full dq buffer never passes through a branch.
            dq_acc = jax.lax.dynamic_update_index_in_dim(dq_acc, dq_acc[i] + dq_c, i, 0)
            return (dk + dk_c, dv + dv_c, dq_acc), None

        zeros = jnp.zeros((b, g, bk, kd), jnp.float32)
        (dk, dv, dq_acc), _ = jax.lax.scan(q_step, (zeros, zeros, dq_acc), jnp.arange(nq))
        return dq_acc, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(k_block, dq0, jnp.arange(nk))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bq: int, bk: int):
    return _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bq, bk)[0]


def _setup(q, k, q_pos, kv_pos, q_seg, kv_seg, bq, bk):
    t, s, g = q.shape[1], k.shape[1], k.shape[2]
    nq, nk = -(-t // bq), -(-s // bk)
    blocks = _Blocks(q_pos, kv_pos, q_seg, kv_seg, t, s, bq, nq, bk, nk)
    return blocks, nq, nk, g, q.shape[2] // g, 1.0 / math.sqrt(q.shape[3])


def _tie_layout(x, layout):
    """(x, layout) through one optimization barrier, so every value computed from the layout
    depends on x. Inside a layer scan (`nn.scan`), JAX's scan partial evaluation hoists
    work that depends only on the scan's constants (the positions and segment ids, the same
    for every layer) out of the loop as loop-invariant residuals; for the block loops that
    would be each block pair's mask, stacked over all (i, j) pairs: a [T, S] array."""
    return jax.lax.optimization_barrier((x, layout))


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bq, bk):
    q, (q_pos, kv_pos, q_seg, kv_seg) = _tie_layout(q, (q_pos, kv_pos, q_seg, kv_seg))
    blocks, nq, nk, g, r, scale = _setup(q, k, q_pos, kv_pos, q_seg, kv_seg, bq, bk)
    qb, kb, vb = _q_blocks(q, g, bq, nq), _kv_blocks(k, bk, nk), _kv_blocks(v, bk, nk)
    ob, lse = _forward(qb, kb, vb, blocks, r, scale)
    out = _q_unblocks(ob, q.shape[1], r)
    return out, (qb, kb, vb, ob, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_bwd(bq, bk, res, dout):
    qb, kb, vb, ob, lse, q_pos, kv_pos, q_seg, kv_seg = res
    dout, (q_pos, kv_pos, q_seg, kv_seg) = _tie_layout(dout, (q_pos, kv_pos, q_seg, kv_seg))
    t, r = dout.shape[1], dout.shape[2] // kb.shape[2]
    s = kv_pos.shape[1]
    nq, nk = qb.shape[0], kb.shape[0]
    blocks = _Blocks(q_pos, kv_pos, q_seg, kv_seg, t, s, bq, nq, bk, nk)
    scale = 1.0 / math.sqrt(qb.shape[-1])
    dob = _q_blocks(dout.astype(ob.dtype), kb.shape[2], bq, nq)
    dq, dk, dv = _backward(qb, kb, vb, ob, lse, dob, blocks, r, scale)
    dq = _q_unblocks(dq, t, r).astype(qb.dtype)
    dk, dv = _kv_unblocks(dk, s).astype(kb.dtype), _kv_unblocks(dv, s).astype(vb.dtype)
    # Positions and segment ids are integers: no cotangent.
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
# Jitted so that eager callers compile the loops once per shape (inlined under an outer jit).
_flash_jit = jax.jit(_flash, static_argnums=(7, 8))


def blockwise_attention(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    q_segment_ids_BxT: jax.Array | None = None,
    kv_segment_ids_BxS: jax.Array | None = None,
    *,
    block_size: int = 512,
) -> jax.Array:
    """Flash-style attention over query/key blocks of at most `block_size`; [B, T, H, K].

    Same result as `reference.causal_attention(q, k, v, make_attention_mask(...))` on every
    query that sees at least one key; a query that sees none gets 0 (and zero gradients).
    Scores, softmax statistics and accumulators are float32; matmul inputs stay in the input
    dtype (p and ds are cast to it, as in FlashAttention). Memory is O(B H T K): no [T, S]
    array in the forward or the backward pass.
    """
    b, t, h, kd = q_BxTxHxK.shape
    s = k_BxSxGxK.shape[1]
    if t == 0 or s == 0:
        return jnp.zeros((b, t, h, kd), q_BxTxHxK.dtype)
    bq, _ = block_split(t, block_size)
    bk, _ = block_split(s, block_size)
    return _flash_jit(
        q_BxTxHxK,
        k_BxSxGxK,
        v_BxSxGxK,
        q_positions_BxT.astype(jnp.int32),
        kv_positions_BxS.astype(jnp.int32),
        None if q_segment_ids_BxT is None else q_segment_ids_BxT.astype(jnp.int32),
        None if kv_segment_ids_BxS is None else kv_segment_ids_BxS.astype(jnp.int32),
        bq,
        bk,
    )
