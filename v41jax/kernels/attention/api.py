"""Entry point of causal grouped-query attention without a materialised mask.

`attend(q, k, v, layout, impl=...)`: who sees whom comes from `AttentionLayout` (positions
and segment ids), never from a [B, T, S] mask in a fast path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from v41jax.kernels.attention.reference import causal_attention, make_attention_mask


class AttentionLayout(NamedTuple):
    """Visibility of keys to queries: key s is visible to query t iff
    `kv_positions[s] <= q_positions[t]` and, when segment ids are given,
    `q_segment_ids[t] == kv_segment_ids[s]`.

    q_positions_BxT, kv_positions_BxS: int32 causal order (token indices without a KV cache,
    cache slots with one). Segment ids: int32 [B, T] / [B, S] or None (one document a row).
    """

    q_positions_BxT: jax.Array
    kv_positions_BxS: jax.Array
    q_segment_ids_BxT: jax.Array | None = None
    kv_segment_ids_BxS: jax.Array | None = None

    def mask(self) -> jax.Array:
        """The boolean [B, T, S] mask (reference path and tests only)."""
        return make_attention_mask(*self)


def attend(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    layout: AttentionLayout,
    *,
    impl: str = "auto",
    block_size: int = 512,
) -> jax.Array:
    """`softmax(q k^T / sqrt(K) + visibility) v` per query head ([B, T, H, K])."""
    del impl, block_size
    return causal_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout.mask())
