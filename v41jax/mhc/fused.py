"""Paper-fused mHC post + residual apply, and the naive unfused form it replaces.

mHC, arXiv 2512.24880: per token, ``x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)`` with
``x_l`` of shape [n, C], H_res [n, n], H_post [1, n]. Given F's output ``y = F(H_pre x_l)``
[C], the post + residual apply is

    x_new[i, :] = sum_j H_res[i, j] x[j, :] + H_post[i] y[:]

``fused_post_residual`` writes it as one expression that XLA fuses into one loop: it reads
the n streams and y once ((n+1)C elements) and writes the n new streams once (nC), the
"paper's fused kernels" traffic (the pre-mix read is a separate pass, see ``mhc_bench``).
``naive_post_residual`` materialises each stage (post-scaled y, mixed streams, their sum)
behind ``lax.optimization_barrier`` so XLA cannot fuse them: the unfused baseline.
Coefficients are fp32; the arithmetic runs in fp32 and the result is cast to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _check(x_BxTxNxC, y_BxTxC, h_post_BxTxN, h_res_BxTxNxN) -> None:
    if x_BxTxNxC.ndim < 2:
        raise ValueError(f"fused_post_residual: x must be [..., n, C], got {x_BxTxNxC.shape}")
    *lead, n, c = x_BxTxNxC.shape
    want = {
        "y": (tuple(lead) + (c,), y_BxTxC.shape),
        "h_post": (tuple(lead) + (n,), h_post_BxTxN.shape),
        "h_res": (tuple(lead) + (n, n), h_res_BxTxNxN.shape),
    }
    for name, (expect, got) in want.items():
        if tuple(got) != expect:
            raise ValueError(
                f"fused_post_residual: {name} must have shape {expect} for x {x_BxTxNxC.shape}, "
                f"got {tuple(got)}"
            )


def fused_post_residual(
    x_BxTxNxC: jax.Array, y_BxTxC: jax.Array, h_post_BxTxN: jax.Array, h_res_BxTxNxN: jax.Array
) -> jax.Array:
    """``x_new = H_res x + H_post^T y`` per token, one fusible expression, x's dtype.

    Shapes: x [..., n, C], y [..., C], h_post [..., n], h_res [..., n, n] -> [..., n, C].
    """
    _check(x_BxTxNxC, y_BxTxC, h_post_BxTxN, h_res_BxTxNxN)
    n = x_BxTxNxC.shape[-2]
    x32 = x_BxTxNxC.astype(jnp.float32)
    y32 = y_BxTxC.astype(jnp.float32)[..., None, :]
    h_res = h_res_BxTxNxN.astype(jnp.float32)
    # An unrolled sum over the n (small) source streams instead of an einsum: XLA lowers an
    # einsum with a contraction to a dot, which does not fuse with the elementwise update.
    mixed = h_post_BxTxN.astype(jnp.float32)[..., :, None] * y32
    for j in range(n):
        mixed = mixed + h_res[..., :, j, None] * x32[..., j, None, :]
    return mixed.astype(x_BxTxNxC.dtype)


def naive_post_residual(
    x_BxTxNxC: jax.Array, y_BxTxC: jax.Array, h_post_BxTxN: jax.Array, h_res_BxTxNxN: jax.Array
) -> jax.Array:
    """The same update with every stage materialised (the unfused HC/mHC baseline).

    Stages: ``post = H_post^T y`` [..., n, C]; ``res = H_res x`` [..., n, C]; ``post + res``.
    Each is separated by an optimization barrier so XLA keeps them as separate passes.
    """
    _check(x_BxTxNxC, y_BxTxC, h_post_BxTxN, h_res_BxTxNxN)
    post = (
        h_post_BxTxN.astype(jnp.float32)[..., :, None] * y_BxTxC.astype(jnp.float32)[..., None, :]
    )
    post = lax.optimization_barrier(post.astype(x_BxTxNxC.dtype))
    res = jnp.einsum(
        "...ij,...jc->...ic",
        h_res_BxTxNxN.astype(jnp.float32),
        x_BxTxNxC.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )
    res = lax.optimization_barrier(res.astype(x_BxTxNxC.dtype))
    out = res.astype(jnp.float32) + post.astype(jnp.float32)
    return out.astype(x_BxTxNxC.dtype)


def pre_mix(x_BxTxNxC: jax.Array, h_pre_BxTxN: jax.Array) -> jax.Array:
    """The pre-mapping ``H_pre x`` [..., C] (fp32 accumulation, x's dtype)."""
    n = x_BxTxNxC.shape[-2]
    h_pre = h_pre_BxTxN.astype(jnp.float32)
    out = h_pre[..., 0, None] * x_BxTxNxC[..., 0, :].astype(jnp.float32)
    for j in range(1, n):
        out = out + h_pre[..., j, None] * x_BxTxNxC[..., j, :].astype(jnp.float32)
    return out.astype(x_BxTxNxC.dtype)
