"""RMSNorm (Zhang & Sennrich 2019) over the last axis, the one definition every package uses.

For x [..., D] and a scale g [D]:

    inv_rms(x) = 1 / sqrt(mean_d(x_d^2) + eps)                          float32 [..., 1]
    rms_norm(x; g) = x * inv_rms(x) * g                                  [..., D]

eps sits inside the square root. The statistics, the product and the scale are float32
whatever x's dtype (a bf16 mean of squares loses the small components); the product is
formed as `(x * inv_rms) * g`, in that order, so every caller gets the same rounding.

Three forms, because callers differ in what they keep:
  `rms_norm`            the layer form: the result is cast back to x's dtype (model blocks).
  `rms_norm_f32`        the same values left in float32 (Engram's gate and conv, mHC's
                        coefficients and the Single-Pass input, which go on in float32).
  `inv_rms`, `inv_rms_from_sumsq`  only the factor 1 / r, for callers that fold the scale
                        elsewhere: RMSNorm(v; g) phi = (v (g ⊙ phi)) / r touches the K
                        projected values instead of the D inputs, and a pass that already
                        produced sum(v^2) need not read v again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["inv_rms", "inv_rms_from_sumsq", "rms_norm", "rms_norm_f32"]


def inv_rms(x_xD: jax.Array, eps: float) -> jax.Array:
    """`1 / sqrt(mean(x^2) + eps)` over the last axis: float32 [..., 1] (keeps the axis so it
    broadcasts against x or a projection of x)."""
    x32 = x_xD.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def inv_rms_from_sumsq(sumsq_x: jax.Array, size: int, eps: float) -> jax.Array:
    """`1 / sqrt(sumsq / size + eps)` from a precomputed sum of squares over `size` values:
    float32 [...] (same shape as sumsq). Equal to `inv_rms(x)[..., 0]` when
    `sumsq = sum(x^2)` over the `size` entries of x's last axis (jnp.mean is that same
    sum divided by the count)."""
    return lax.rsqrt(sumsq_x.astype(jnp.float32) / size + eps)


def rms_norm_f32(x_xD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps) * scale` over the last axis, float32 [..., D].

    x [..., D] in any float dtype, scale [D] (or anything broadcasting against x, e.g.
    per-branch scales [M, D] for x [B, T, M, D]).
    """
    return x_xD.astype(jnp.float32) * inv_rms(x_xD, eps) * scale_D.astype(jnp.float32)


def rms_norm(x_xD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps) * scale` over the last axis, returned in x's dtype.

    x [..., D], scale [D]; computed in float32 (`rms_norm_f32`) and cast back once.
    """
    return rms_norm_f32(x_xD, scale_D, eps).astype(x_xD.dtype)
