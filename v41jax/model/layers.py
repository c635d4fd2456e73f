"""Pure-JAX layer cores (RoPE, SwiGLU) and the thin Linen shells that own their params.

RMSNorm's core is `v41jax.ops.rms_norm` (shared with Engram and mHC); it is re-exported here
for the model package's callers.

Cores take explicit arrays and return arrays, so any JAX code (Linen, NNX via `nnx.bridge`,
raw `jit`/`shard_map`, a Pallas reference) can reuse them. Shape suffixes name the axes:
B batch, T query length, D model width, F FFN width, H heads, K head dim, V vocab.

Dtypes: params are stored in `param_dtype` and cast to `dtype` (the compute dtype) for the
matmuls; normalisation statistics and logits are computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.ops import rms_norm

Dtype = Any

# ----------------------------------------------------------------------------- pure cores


def rope_angles(positions_BxT: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotation angles `pos * theta^(-2i/K)` for i in [0, K/2): float32 [B, T, K/2]."""
    inv_freq_K2 = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return positions_BxT.astype(jnp.float32)[..., None] * inv_freq_K2


def apply_rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), rotate-half (GPT-NeoX / Llama) layout.

    Dimension i is paired with i + K/2 (not with its neighbour, as in the interleaved
    layout): with x = [x1, x2] split in halves and angles a = `rope_angles`,
    `rope(x) = [x1 cos a - x2 sin a, x2 cos a + x1 sin a]`. Computed in float32 and cast back.
    Then <rope(q, m), rope(k, n)> depends on positions only through m - n.
    """
    k = x_BxTxHxK.shape[-1]
    angles_BxTx1xK2 = rope_angles(positions_BxT, k, theta)[:, :, None, :]
    sin, cos = jnp.sin(angles_BxTx1xK2), jnp.cos(angles_BxTx1xK2)
    x32 = x_BxTxHxK.astype(jnp.float32)
    x1, x2 = x32[..., : k // 2], x32[..., k // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxK.dtype)


def swiglu(
    x_BxTxD: jax.Array,
    w_gate_DxF: jax.Array,
    w_up_DxF: jax.Array,
    w_down_FxD: jax.Array,
    constrain_hidden: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """SwiGLU FFN (Shazeer 2020): `y = (silu(x W_gate) * (x W_up)) W_down`.

    `constrain_hidden`, if given, is applied to the [B, T, F] hidden activation (the Linen
    shell passes a logical sharding constraint). Matmuls run in the dtype of the inputs.
    """
    gate_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w_gate_DxF)
    up_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w_up_DxF)
    h_BxTxF = jax.nn.silu(gate_BxTxF) * up_BxTxF
    if constrain_hidden is not None:
        h_BxTxF = constrain_hidden(h_BxTxF)
    return jnp.einsum("btf,fd->btd", h_BxTxF, w_down_FxD)


# ----------------------------------------------------------------------------- Linen shells


def normal_init(std: float, names: tuple[str, ...]) -> Callable:
    """N(0, std^2) initializer carrying the logical axis names of the param it makes."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), names)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; param `scale` [D] (logical `norm`), initialised to ones.

    `y = x / sqrt(mean(x^2) + eps) * scale`, [..., D] -> [..., D] in x's dtype (statistics in
    float32): a shell owning the param around `v41jax.ops.rms_norm`.
    """

    eps: float = 1e-6
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x_BxTxD.shape[-1],),
            self.param_dtype,
        )
        return rms_norm(x_BxTxD, scale_D, self.eps)


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN; params `w_gate`, `w_up` [D, F] (embed, mlp), `w_down` [F, D] (mlp, embed).

    `out_init_std` initialises `w_down` (the projection back into the residual stream).
    """

    d_ff: int
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        d = x_BxTxD.shape[-1]
        shape_in, shape_out = (d, self.d_ff), (self.d_ff, d)
        w_gate = self.param(
            "w_gate", normal_init(self.init_std, ("embed", "mlp")), shape_in, self.param_dtype
        )
        w_up = self.param(
            "w_up", normal_init(self.init_std, ("embed", "mlp")), shape_in, self.param_dtype
        )
        w_down = self.param(
            "w_down", normal_init(self.out_init_std, ("mlp", "embed")), shape_out, self.param_dtype
        )
        return swiglu(
            x_BxTxD.astype(self.dtype),
            w_gate.astype(self.dtype),
            w_up.astype(self.dtype),
            w_down.astype(self.dtype),
            constrain_hidden=lambda h: nn.with_logical_constraint(
                h, ("batch", "length", "act_mlp")
            ),
        )


class Embed(nn.Module):
    """Token embedding table `embedding` [V, D] (vocab, embed); `.attend` is the tied LM head."""

    num_embeddings: int
    features: int
    init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            normal_init(self.init_std, ("vocab", "embed")),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        """Row lookup: int [B, T] -> [B, T, D] in the compute dtype."""
        return jnp.take(self.embedding, tokens_BxT, axis=0).astype(self.dtype)

    def attend(self, x_BxTxD: jax.Array) -> jax.Array:
        """Tied head: `logits = x E^T`, [B, T, V], accumulated and returned in float32."""
        return jnp.einsum(
            "btd,vd->btv",
            x_BxTxD.astype(self.dtype),
            self.embedding.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
