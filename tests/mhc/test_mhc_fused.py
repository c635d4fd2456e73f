"""Paper-fused post + residual apply: fused == naive == the reference update (mhc_apply)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.mhc.fused import fused_post_residual, naive_post_residual, pre_mix
from v41jax.mhc.reference import mhc_apply


def _inputs(n, c, dtype, seed=0, lead=(2, 7)):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    x = f(*lead, n, c).astype(dtype)
    y = f(*lead, c).astype(dtype)
    h_pre = jax.nn.sigmoid(f(*lead, n))
    h_post = 2 * jax.nn.sigmoid(f(*lead, n))
    h_res = jax.nn.softmax(f(*lead, n, n), axis=-1)
    return x, y, h_pre, h_post, h_res


@pytest.mark.parametrize("n,c", [(4, 13), (3, 16), (1, 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_equals_naive_equals_reference(n, c, dtype):
    x, y, h_pre, h_post, h_res = _inputs(n, c, dtype)
    # mhc_apply computes F(H_pre x); a constant F makes its update the post + residual apply.
    ref, _ = mhc_apply(x, lambda h: (y, None), (h_pre, h_post, h_res))
    fused = jax.jit(fused_post_residual)(x, y, h_post, h_res)
    naive = jax.jit(naive_post_residual)(x, y, h_post, h_res)
    assert fused.shape == x.shape and fused.dtype == dtype and naive.dtype == dtype
    # bf16: naive rounds its materialised stages to bf16, so allow a few bf16 ulps.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    as32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(as32(fused), as32(ref), **tol)
    np.testing.assert_allclose(as32(naive), as32(ref), **tol)


def test_pre_mix_and_gradients():
    x, y, h_pre, h_post, h_res = _inputs(4, 13, jnp.float32, seed=1)
    want = jnp.einsum("...n,...nc->...c", h_pre, x, precision="highest")
    np.testing.assert_allclose(pre_mix(x, h_pre), want, rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    g_f = jax.grad(loss(fused_post_residual), argnums=(0, 1, 2, 3))(x, y, h_post, h_res)
    g_n = jax.grad(loss(naive_post_residual), argnums=(0, 1, 2, 3))(x, y, h_post, h_res)
    for a, b in zip(g_f, g_n, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_bad_shapes_raise():
    x, y, _, h_post, h_res = _inputs(4, 13, jnp.float32)
    with pytest.raises(ValueError, match="y must have shape"):
        fused_post_residual(x, y[..., :3], h_post, h_res)
    with pytest.raises(ValueError, match="h_res must have shape"):
        naive_post_residual(x, y, h_post, h_res[..., :3, :])
    with pytest.raises(ValueError, match="h_post must have shape"):
        fused_post_residual(x, y, h_post[..., :2], h_res)
