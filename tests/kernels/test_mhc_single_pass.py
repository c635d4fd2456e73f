"""Single-Pass mHC step kernel: XLA, Pallas (interpreted) and the reference agree.

Odd sizes (T=7 tokens, C=13, n=3; and [2, 5] tokens with n=4) so no dimension is a multiple
of a block; block_tokens=4 gives several grid steps plus a padded tail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.mhc_single_pass import mhc_single_pass, single_pass_step_reference

SHAPES = [((7,), 3, 13), ((2, 5), 4, 16)]
IMPLS = [("xla", False), ("pallas", True), ("reference", False)]


def _inputs(lead, n, c, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    k = n * n + 2 * n
    return (
        f(*lead, n, c).astype(dtype),
        f(*lead, c).astype(dtype),
        jax.nn.softmax(f(*lead, n, n), axis=-1),
        2 * jax.nn.sigmoid(f(*lead, n)),
        jax.nn.sigmoid(f(*lead, n)),
        f(n * c, k) / np.sqrt(n * c),
        1.0 + 0.1 * f(c),
    )


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("lead,n,c", SHAPES)
@pytest.mark.parametrize("with_phi,with_norm", [(True, True), (False, False)])
def test_forward_matches_reference(impl, interpret, lead, n, c, with_phi, with_norm):
    x, y, h_res, h_post, a_pre, phi, g = _inputs(lead, n, c)
    phi, g = (phi if with_phi else None), (g if with_norm else None)
    args = (x, y, h_res, h_post, a_pre, phi, g)
    out = mhc_single_pass(*args, impl=impl, interpret=interpret, block_tokens=4)
    ref = single_pass_step_reference(*args)
    assert out[0].shape == (*lead, n, c) and out[1].shape == (*lead, c)
    if with_phi:
        assert out[2].shape == (*lead, n * n + 2 * n) and out[3].shape == lead
    else:
        assert out[2] is None and out[3] is None
    for a, b in zip(out, ref, strict=True):
        if b is not None:
            _close(a, b, dict(rtol=2e-5, atol=2e-5))


@pytest.mark.parametrize("impl,interpret", IMPLS[:2])
def test_bf16_stream_and_compute_dtype(impl, interpret):
    x, y, h_res, h_post, a_pre, phi, g = _inputs((7,), 4, 13, seed=1, dtype=jnp.bfloat16)
    args = (x, y, h_res, h_post, a_pre, phi, g)
    out = mhc_single_pass(*args, impl=impl, interpret=interpret, block_tokens=4)
    ref = single_pass_step_reference(*args)
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == jnp.bfloat16
    assert out[2].dtype == jnp.float32
    for a, b in zip(out, ref, strict=True):
        _close(a, b, dict(rtol=2e-2, atol=2e-2))


@pytest.mark.parametrize("impl,interpret", IMPLS[:2])
@pytest.mark.parametrize("lead,n,c", SHAPES)
def test_gradients_match_reference(impl, interpret, lead, n, c):
    args = _inputs(lead, n, c, seed=2)

    def loss(fn, *a):
        x_new, h, proj, sumsq = fn(*a)
        return (
            jnp.sum(jnp.sin(x_new))
            + jnp.sum(jnp.cos(h))
            + jnp.sum(jnp.tanh(proj))
            + 1e-2 * jnp.sum(sumsq)
        )

    ours = lambda *a: mhc_single_pass(*a, impl=impl, interpret=interpret, block_tokens=4)
    g_ours = jax.grad(lambda *a: loss(ours, *a), argnums=tuple(range(7)))(*args)
    g_ref = jax.grad(lambda *a: loss(single_pass_step_reference, *a), argnums=tuple(range(7)))(
        *args
    )
    for a, b in zip(g_ours, g_ref, strict=True):
        _close(a, b, dict(rtol=1e-4, atol=1e-4))


def test_jit_pallas_matches_xla():
    args = _inputs((7,), 4, 13, seed=3)
    f = jax.jit(lambda *a: mhc_single_pass(*a, impl="pallas", interpret=True, block_tokens=8))
    for a, b in zip(f(*args), mhc_single_pass(*args, impl="xla"), strict=True):
        _close(a, b, dict(rtol=2e-5, atol=2e-5))


def test_bad_shapes_and_options_raise():
    x, y, h_res, h_post, a_pre, phi, g = _inputs((7,), 4, 13)
    with pytest.raises(ValueError, match=r"y must have shape \(7, 13\)"):
        mhc_single_pass(x, y[:, :5], h_res, h_post, a_pre)
    with pytest.raises(ValueError, match="h_res must have shape"):
        mhc_single_pass(x, y, h_res[:, :3], h_post, a_pre)
    with pytest.raises(ValueError, match=r"phi must be \[n\*C, K\]"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, phi[:10])
    with pytest.raises(ValueError, match="norm_scale must be"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, phi, g[:4])
    with pytest.raises(ValueError, match="at least one token axis"):
        mhc_single_pass(x[0], y[0], h_res[0], h_post[0], a_pre[0])
    with pytest.raises(ValueError, match="impl must be one of"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="cuda")
    with pytest.raises(ValueError, match="interpret=True"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="pallas")
    with pytest.raises(ValueError, match="block_tokens"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="pallas", interpret=True, block_tokens=0)
