"""Causal grouped-query attention: pure cores, a KV-cache update, and the Linen `Attention`.

Shapes: B batch, T query length, S key length (T without a cache, `max_seq_len` with one),
H query heads, G key/value heads (H % G == 0; G < H is GQA, Ainslie et al. 2023),
R = H / G query heads per kv head, K head dim, D model width.

KV cache: one dict per layer `{"k": [B, S, G, K], "v": [B, S, G, K]}` in the compute dtype.
Slot s holds the key/value of absolute position s. A call with T new tokens writes row b's
tokens at slots `cache_index[b] .. cache_index[b] + T - 1` and its queries attend to slots
`<= cache_index[b] + t`. Slots past a row's own position may hold garbage (right-padding of a
prefill); they are masked out and overwritten as decoding reaches them. Prefill and decode
are the same code path (prefill: T = prompt length, cache_index = 0).

Packed rows (`PackedRows`, ragged verification): the input is [1, N, D], N tokens of the
cache's B rows on one axis, row b's n_b tokens consecutive (their slots start_B[b] ..).
Every per-token computation (projections, RoPE, the FFN, the head) runs over the N tokens
alone, so its cost follows N = sum n_b, not B x max n_b. The new keys and values are
scattered to (row, slot); attention gathers each row's queries into a [B, W] block (W the
most tokens a row may have), attends to that row's cache as a T = W call would, and gathers
the outputs back: the same numbers as the [B, T] call on each row's own tokens. Attention
reads the cache once per row either way, so padding its queries to W costs little.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.kernels.attention import (  # noqa: F401 (re-exported for model users)
    AttentionLayout,
    attend,
    attention_reference,
    causal_attention,
    make_attention_mask,
)
from v41jax.model.layers import RMSNorm, apply_rope, normal_init
from v41jax.model.remat import KEY_PROJ, QUERY_PROJ, VALUE_PROJ, tag

Dtype = Any
KVCache = dict[str, jax.Array]


def update_cache(
    cache_BxSxGxK: jax.Array, new_BxTxGxK: jax.Array, cache_index_B: jax.Array
) -> jax.Array:
    """Write row b's T new entries at slots `cache_index[b] ..`; returns the updated cache.

    The caller guarantees `cache_index[b] + T <= S`: `lax.dynamic_update_slice` would clamp
    the start (shifting the write) rather than fail.
    """

    def write_row(cache_SxGxK, new_TxGxK, start):
        return jax.lax.dynamic_update_slice(
            cache_SxGxK, new_TxGxK.astype(cache_SxGxK.dtype), (start, 0, 0)
        )

    return jax.vmap(write_row)(cache_BxSxGxK, new_BxTxGxK, cache_index_B.astype(jnp.int32))


class PackedRows(NamedTuple):
    """N tokens of a KV cache's B rows packed on one token axis (see the module docstring).

    row_N int32 [N]: the cache row of token n; B marks a padding token (written nowhere,
        its outputs unread). slot_N int32 [N]: its cache slot (= its position).
    index_BxW int32 [B, W]: the flat index of row b's w-th token, N where row b has fewer
        than w + 1 tokens. start_B int32 [B]: the slot of row b's first token.
    Built by `pack_rows`."""

    row_N: jax.Array
    slot_N: jax.Array
    index_BxW: jax.Array
    start_B: jax.Array

    @property
    def width(self) -> int:
        return self.index_BxW.shape[1]

    def layout(self, cache_len: int) -> AttentionLayout:
        """The [B, W] queries' view of the cache: query w of row b sits at slot start + w."""
        b, w = self.index_BxW.shape
        q_slots_BxW = self.start_B[:, None] + jnp.arange(w, dtype=jnp.int32)
        kv_slots_BxS = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (b, cache_len))
        return AttentionLayout(q_slots_BxW, kv_slots_BxS)

    def to_rows(self, x_NxF: jax.Array) -> jax.Array:
        """[N, ...] -> [B, W, ...]: row b's tokens in order, zeros past its count."""
        pad = jnp.zeros((1, *x_NxF.shape[1:]), x_NxF.dtype)
        return jnp.concatenate([x_NxF, pad])[self.index_BxW]

    def from_rows(self, x_BxWxF: jax.Array) -> jax.Array:
        """[B, W, ...] -> [N, ...]: the inverse of `to_rows` (padding tokens read row B - 1)."""
        b, w = self.index_BxW.shape
        row = jnp.minimum(self.row_N, b - 1)
        col = jnp.clip(self.slot_N - self.start_B[row], 0, w - 1)
        return x_BxWxF[row, col]


def pack_rows(counts_B: jax.Array, start_B: jax.Array, n: int, width: int) -> PackedRows:
    """`PackedRows` for row b's `counts_B[b]` tokens at slots start_B[b] .. (counts in
    [0, width], their sum <= n; rows in order, tokens past the sum are padding).

    counts_B, start_B: int32 [B]; n, width: static ints."""
    counts_B = jnp.asarray(counts_B, jnp.int32)
    start_B = jnp.asarray(start_B, jnp.int32)
    b = counts_B.shape[0]
    ends_B = jnp.cumsum(counts_B)
    offsets_B = ends_B - counts_B
    flat_N = jnp.arange(n, dtype=jnp.int32)
    row_N = jnp.searchsorted(ends_B, flat_N, side="right").astype(jnp.int32)  # B past the end
    safe_N = jnp.minimum(row_N, b - 1)
    slot_N = jnp.where(row_N < b, start_B[safe_N] + flat_N - offsets_B[safe_N], 0)
    w_W = jnp.arange(width, dtype=jnp.int32)
    index_BxW = jnp.where(w_W < counts_B[:, None], offsets_B[:, None] + w_W, n)
    return PackedRows(row_N, slot_N.astype(jnp.int32), index_BxW.astype(jnp.int32), start_B)


def update_cache_packed(
    cache_BxSxGxK: jax.Array, new_NxGxK: jax.Array, packed: PackedRows
) -> jax.Array:
    """Write token n's entry at (row_N[n], slot_N[n]); padding tokens (row B) are dropped."""
    new = new_NxGxK.astype(cache_BxSxGxK.dtype)
    return cache_BxSxGxK.at[packed.row_N, packed.slot_N].set(new, mode="drop")


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with RoPE and an optional KV cache.

    Params: `q` [D, H, K] (embed, heads, head_dim); `k`, `v` [D, G, K] (embed, kv_heads,
    head_dim); `o` [H, K, D] (heads, head_dim, embed); with `qkv_bias` also `q_bias` [H, K],
    `k_bias`, `v_bias` [G, K] (Qwen2); with `qk_norm` RMSNorms `q_norm`, `k_norm` (scale
    [K]) over each head's q and k before RoPE (Qwen3).
    `y = attend(rope(n(x Wq + bq)), rope(n(x Wk + bk)), x Wv + bv, layout) Wo` with `impl` one of
    `v41jax.config.ATTENTION_IMPLS` (see `v41jax.kernels.attention.api`). The default
    "auto" picks by the platform the program is lowered for: blockwise (flash-style XLA,
    memory linear in T) on CPU, cuDNN flash attention on CUDA for bf16/fp16 without packed
    segments, splash attention on TPU; KV-cache layouts (T new queries at cache offsets over
    S slots) take the blockwise path on every platform except cuDNN's T = 1 decode.
    `block_size` is the blockwise/splash query and key block.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    impl: str = "auto"
    block_size: int = 512
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6

    @nn.compact
    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        layout: AttentionLayout,
        cache: KVCache | None = None,
        cache_index_B: jax.Array | None = None,
        packed: PackedRows | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, D] -> (y [B, T, D], new cache or None).

        `positions_BxT` drive RoPE; `layout` says which keys each query sees. Without a
        cache S = T; with one, S = cache length and `cache_index_B` gives each row's first
        write slot. With `packed` (and a cache), x is [1, N, D], the packed tokens of the
        cache's rows (module docstring); `layout` is then `packed.layout(S)`.
        """
        d, h, g, k = x_BxTxD.shape[-1], self.num_heads, self.num_kv_heads, self.head_dim
        std, pd = self.init_std, self.param_dtype
        w_q = self.param("q", normal_init(std, ("embed", "heads", "head_dim")), (d, h, k), pd)
        w_k = self.param("k", normal_init(std, ("embed", "kv_heads", "head_dim")), (d, g, k), pd)
        w_v = self.param("v", normal_init(std, ("embed", "kv_heads", "head_dim")), (d, g, k), pd)
        w_o = self.param(
            "o", normal_init(self.out_init_std, ("heads", "head_dim", "embed")), (h, k, d), pd
        )
        x = x_BxTxD.astype(self.dtype)
        # Tagged for remat_policy="save_qkv_proj" (v41jax.model.remat).
        q_BxTxHxK = tag(jnp.einsum("btd,dhk->bthk", x, w_q.astype(self.dtype)), QUERY_PROJ)
        k_BxTxGxK = tag(jnp.einsum("btd,dgk->btgk", x, w_k.astype(self.dtype)), KEY_PROJ)
        v_BxTxGxK = tag(jnp.einsum("btd,dgk->btgk", x, w_v.astype(self.dtype)), VALUE_PROJ)
        if self.qkv_bias:
            zeros = lambda axes: nn.with_logical_partitioning(nn.initializers.zeros, axes)  # noqa: E731
            b_q = self.param("q_bias", zeros(("heads", "head_dim")), (h, k), pd)
            b_k = self.param("k_bias", zeros(("kv_heads", "head_dim")), (g, k), pd)
            b_v = self.param("v_bias", zeros(("kv_heads", "head_dim")), (g, k), pd)
            q_BxTxHxK = q_BxTxHxK + b_q.astype(self.dtype)
            k_BxTxGxK = k_BxTxGxK + b_k.astype(self.dtype)
            v_BxTxGxK = v_BxTxGxK + b_v.astype(self.dtype)
        if self.qk_norm:
            q_BxTxHxK = RMSNorm(self.norm_eps, pd, name="q_norm")(q_BxTxHxK)
            k_BxTxGxK = RMSNorm(self.norm_eps, pd, name="k_norm")(k_BxTxGxK)
        q_BxTxHxK = apply_rope(q_BxTxHxK, positions_BxT, self.rope_theta)
        k_BxTxGxK = apply_rope(k_BxTxGxK, positions_BxT, self.rope_theta)
        q_BxTxHxK = nn.with_logical_constraint(q_BxTxHxK, ("batch", "length", "act_heads", None))
        kv_axes = ("batch", "length", "act_kv_heads", None)
        k_BxTxGxK = nn.with_logical_constraint(k_BxTxGxK, kv_axes)
        v_BxTxGxK = nn.with_logical_constraint(v_BxTxGxK, kv_axes)

        if packed is not None:
            if cache is None:
                raise ValueError("Attention: packed rows need a KV cache")
            new_cache = {
                name: nn.with_logical_constraint(
                    update_cache_packed(cache[name], new[0], packed),
                    ("batch", "cache_length", "act_kv_heads", None),
                )
                for name, new in (("k", k_BxTxGxK), ("v", v_BxTxGxK))
            }
            out_BxWxHxK = attend(
                packed.to_rows(q_BxTxHxK[0]),
                new_cache["k"],
                new_cache["v"],
                layout,
                impl=self.impl,
                block_size=self.block_size,
            )
            out_BxTxHxK = packed.from_rows(out_BxWxHxK)[None]
            y_BxTxD = jnp.einsum("bthk,hkd->btd", out_BxTxHxK, w_o.astype(self.dtype))
            return y_BxTxD, new_cache

        new_cache = None
        if cache is not None:
            if cache_index_B is None:
                raise ValueError("Attention: a KV cache needs cache_index_B (first write slot)")
            cache_axes = ("batch", "cache_length", "act_kv_heads", None)
            new_cache = {
                name: nn.with_logical_constraint(
                    update_cache(cache[name], new, cache_index_B), cache_axes
                )
                for name, new in (("k", k_BxTxGxK), ("v", v_BxTxGxK))
            }
            k_BxSxGxK, v_BxSxGxK = new_cache["k"], new_cache["v"]
        else:
            k_BxSxGxK, v_BxSxGxK = k_BxTxGxK, v_BxTxGxK

        out_BxTxHxK = attend(
            q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout, impl=self.impl, block_size=self.block_size
        )
        out_BxTxHxK = nn.with_logical_constraint(
            out_BxTxHxK, ("batch", "length", "act_heads", None)
        )
        y_BxTxD = jnp.einsum("bthk,hkd->btd", out_BxTxHxK, w_o.astype(self.dtype))
        return y_BxTxD, new_cache
