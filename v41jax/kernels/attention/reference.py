"""Plain attention with a materialised [B, T, S] mask: the reference every fast path is
tested against (and the form small callers such as the DSpark drafter use directly).

Shapes: B batch, T queries, S keys, H query heads, G key/value heads (H % G == 0; G < H is
GQA, Ainslie et al. 2023), R = H / G, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_attention_mask(
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    q_segment_ids_BxT: jax.Array | None = None,
    kv_segment_ids_BxS: jax.Array | None = None,
) -> jax.Array:
    """Boolean [B, T, S]: key s is visible to query t iff `kv_pos[s] <= q_pos[t]` and,
    when segment ids are given, both lie in the same segment (packed documents).

    Positions here are the order used for causality: token indices without a cache, slot
    indices (= absolute positions) with one.
    """
    mask_BxTxS = kv_positions_BxS[:, None, :] <= q_positions_BxT[:, :, None]
    if q_segment_ids_BxT is not None:
        same_BxTxS = q_segment_ids_BxT[:, :, None] == kv_segment_ids_BxS[:, None, :]
        mask_BxTxS = mask_BxTxS & same_BxTxS
    return mask_BxTxS


def causal_attention(
    q_BxTxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """`softmax(q k^T / sqrt(K) + mask) v` with grouped kv heads; returns [B, T, H, K].

    Query head h uses kv head h // R (H reshaped to G x R, no repeated copy of k/v).
    Scores and softmax in float32; the weighted sum in v's dtype. Causality comes from the
    mask (see `make_attention_mask`); every query must see at least one key.
    """
    b, t, h, k = q_BxTxHxK.shape
    g = k_BxSxGxK.shape[2]
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={g}")
    q_BxTxGxRxK = q_BxTxHxK.reshape(b, t, g, h // g, k)
    scores_BxGxRxTxS = jnp.einsum(
        "btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32
    ) * (1.0 / jnp.sqrt(jnp.float32(k)))
    scores_BxGxRxTxS = jnp.where(
        mask_BxTxS[:, None, None], scores_BxGxRxTxS, jnp.finfo(jnp.float32).min
    )
    probs_BxGxRxTxS = jax.nn.softmax(scores_BxGxRxTxS, axis=-1).astype(v_BxSxGxK.dtype)
    out_BxTxGxRxK = jnp.einsum("bgrts,bsgk->btgrk", probs_BxGxRxTxS, v_BxSxGxK)
    return out_BxTxGxRxK.reshape(b, t, h, k)


def attention_reference(
    q_BxTxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """Plain multi-head reference: kv heads repeated to H, all in float32."""
    r = q_BxTxHxK.shape[2] // k_BxSxGxK.shape[2]
    k_BxSxHxK = jnp.repeat(k_BxSxGxK, r, axis=2).astype(jnp.float32)
    v_BxSxHxK = jnp.repeat(v_BxSxGxK, r, axis=2).astype(jnp.float32)
    q = q_BxTxHxK.astype(jnp.float32)
    scores_BxHxTxS = jnp.einsum("bthk,bshk->bhts", q, k_BxSxHxK) / jnp.sqrt(q.shape[-1])
    scores_BxHxTxS = jnp.where(mask_BxTxS[:, None], scores_BxHxTxS, -jnp.inf)
    return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores_BxHxTxS, axis=-1), v_BxSxHxK)
