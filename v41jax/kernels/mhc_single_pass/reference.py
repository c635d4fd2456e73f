"""Step-by-step (unfused) reference of one Single-Pass mHC step (the lagged form).

Per token, with the coefficients of X_l already known (B = H_res [n, n], c = H_post [n],
a = H_pre [n], all fp32) and F's output y [C]:

    X_{l+1} = B X_l + c^T y                                    [n, C] (stored in X's dtype)
    h_{l+1} = RMSNorm(a X_{l+1}; g) cast to the compute dtype  [C]   (identity if g is None)
    proj    = vec(X_{l+1}) phi'                                [n^2 + 2n] fp32
    sumsq   = sum(X_{l+1}^2)                                   []    fp32

phi' = diag(coefficient-norm scale) phi is [nC, n^2 + 2n] (vec is row-major over [n, C]);
proj / r with r = sqrt(sumsq / (nC) + eps) is then ``RMSNorm(vec X_{l+1}) phi``, so the
next coefficients need only these n^2 + 2n + 1 numbers per token. Each stage below is a
separate materialised array: this is the definition the fused forms are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from v41jax import ops

_HI = lax.Precision.HIGHEST


def rms_norm_f32(x_xC: jax.Array, scale_C: jax.Array | None, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, fp32; identity if scale is
    None (a sub-layer without an input norm)."""
    if scale_C is None:
        return x_xC
    return ops.rms_norm_f32(x_xC, scale_C, eps)


def single_pass_step_reference(
    x_NxnxC: jax.Array,
    y_NxC: jax.Array,
    h_res_Nxnxn: jax.Array,
    h_post_Nxn: jax.Array,
    a_pre_Nxn: jax.Array,
    phi_nCxK: jax.Array | None = None,
    norm_scale_C: jax.Array | None = None,
    *,
    norm_eps: float = 1e-6,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One lagged single-pass step, unfused: ``(x_new, h_next, proj, sumsq)``.

    Shapes (any leading dims ``...`` in place of N): x [..., n, C], y [..., C],
    h_res [..., n, n], h_post [..., n], a_pre [..., n], phi [n*C, K] or None (then proj and
    sumsq are None), norm_scale [C] or None (no normalisation). x_new has x's dtype, h_next
    ``out_dtype`` (default x's dtype), proj [..., K] and sumsq [...] are fp32.
    """
    out_dtype = x_NxnxC.dtype if out_dtype is None else out_dtype
    x32 = x_NxnxC.astype(jnp.float32)
    res = jnp.einsum("...ij,...jc->...ic", h_res_Nxnxn.astype(jnp.float32), x32, precision=_HI)
    post = h_post_Nxn.astype(jnp.float32)[..., :, None] * y_NxC.astype(jnp.float32)[..., None, :]
    x_new = (res + post).astype(x_NxnxC.dtype)
    xn32 = x_new.astype(jnp.float32)
    mixed = jnp.einsum("...j,...jc->...c", a_pre_Nxn.astype(jnp.float32), xn32, precision=_HI)
    h_next = rms_norm_f32(mixed, norm_scale_C, norm_eps).astype(out_dtype)
    if phi_nCxK is None:
        return x_new, h_next, None, None
    v = xn32.reshape(*xn32.shape[:-2], -1)
    proj = jnp.matmul(v, phi_nCxK.astype(jnp.float32), precision=_HI)
    sumsq = jnp.sum(jnp.square(v), axis=-1)
    return x_new, h_next, proj, sumsq
