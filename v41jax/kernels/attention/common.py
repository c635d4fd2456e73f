"""The attention layout (who sees whom) and the predicates the kernels' routing uses.

Kernels with a built-in causal mask (cuDNN flash attention, Pallas splash attention) see
causality by INDEX: query t sees key s iff s <= t. `AttentionLayout` says it by POSITION:
key s is visible to query t iff kv_pos[s] <= q_pos[t]. The two agree exactly when T = S and
kv_pos = q_pos is strictly increasing along the row (then kv_pos[s] <= q_pos[t] iff s <= t):
the transformer's layout without a KV cache (q = kv positions = arange(T)). `index_causal`
tests that on device, so a kernel runs only where it is exact and any other layout takes
the blockwise path instead (see `api.attend`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from v41jax.kernels.attention.reference import make_attention_mask


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

    @property
    def has_segments(self) -> bool:
        return self.q_segment_ids_BxT is not None


def index_causal(layout: AttentionLayout) -> jax.Array:
    """Scalar bool: the layout is index-causal self-attention (T = S, kv_pos = q_pos strictly
    increasing per row, and q and kv segment ids equal), i.e. exactly `s <= t` plus the
    segment test, and every query sees at least itself. Needs T == S (checked statically by
    the caller)."""
    q_pos, kv_pos = layout.q_positions_BxT, layout.kv_positions_BxS
    ok = jnp.all(kv_pos == q_pos) & jnp.all(q_pos[:, 1:] > q_pos[:, :-1])
    if layout.has_segments:
        ok &= jnp.all(layout.q_segment_ids_BxT == layout.kv_segment_ids_BxS)
    return ok


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
