"""Reference mHC: coefficient paths, the update against numpy, n = 1, init, gains, the layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.mhc.config import MHCConfig
from v41jax.mhc.layer import MHCResidual
from v41jax.mhc.reference import (
    RMS_EPS,
    composite_gain,
    expand_streams,
    mhc_apply,
    mhc_coefficients,
    mhc_params_init,
    num_coeffs,
    reduce_streams,
    static_bias,
)
from v41jax.mhc.sinkhorn import V4_EPS, sinkhorn_knopp


def sinkhorn_numpy(z, iters, variant):
    """float64 Sinkhorn (test_mhc_sinkhorn.py has the commented copy; importlib mode
    keeps test modules from importing each other)."""
    if variant == "paper":
        m = np.exp(z - z.max(axis=(-2, -1), keepdims=True))
        for _ in range(iters):
            m = m / m.sum(-2, keepdims=True)
            m = m / m.sum(-1, keepdims=True)
        return m
    e = np.exp(z - z.max(-1, keepdims=True))
    m = e / e.sum(-1, keepdims=True) + V4_EPS
    m = m / (m.sum(-2, keepdims=True) + V4_EPS)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdims=True) + V4_EPS)
        m = m / (m.sum(-2, keepdims=True) + V4_EPS)
    return m


def random_params(n, c, residual="mhc", seed=0):
    """Params far from init, so every term of the coefficients matters."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    k = num_coeffs(n)
    return {
        "phi": jax.random.normal(k1, (n * c, k)) / np.sqrt(n * c),
        "norm_scale": 1.0 + 0.3 * jax.random.normal(k2, (n * c,)),
        "alpha": jnp.array([0.7, -0.4, 1.3]),
        "bias": static_bias(n, residual) + 0.3 * jax.random.normal(k3, (k,)),
    }, k4


def coeffs_numpy(params, x, n, residual, iters=20, variant="paper"):
    """Direct path in float64: RMSNorm(vec x) phi, gated, biased, activated."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    v = np.asarray(x, np.float64).reshape(*x.shape[:-2], -1)
    v = v / np.sqrt(np.mean(v**2, -1, keepdims=True) + RMS_EPS) * p["norm_scale"]
    proj = v @ p["phi"]
    if residual == "hc":
        proj = np.tanh(proj)
    a = p["alpha"]
    t = np.concatenate(
        [a[0] * proj[..., :n], a[1] * proj[..., n : 2 * n], a[2] * proj[..., 2 * n :]], -1
    )
    t = t + p["bias"]
    pre, post, res = t[..., :n], t[..., n : 2 * n], t[..., 2 * n :].reshape(*t.shape[:-1], n, n)
    if residual == "hc":
        return pre, post, res
    sig = lambda z: 1 / (1 + np.exp(-z))
    return sig(pre), 2 * sig(post), sinkhorn_numpy(res, iters, variant)


def make_sublayer(c, seed=9):
    w = jax.random.normal(jax.random.PRNGKey(seed), (c, c)) / np.sqrt(c)
    fn = lambda h: (jnp.tanh(jnp.matmul(h, w.astype(h.dtype), precision="highest")), {"s": 1})
    fn_np = lambda h: np.tanh(h @ np.asarray(w, np.float64))
    return fn, fn_np


@pytest.mark.parametrize("residual", ["mhc", "hc"])
@pytest.mark.parametrize("n", [1, 4])
def test_project_first_equals_direct(residual, n):
    cfg = MHCConfig(n_streams=n, residual=residual)
    params, key = random_params(n, 16, residual)
    x = 3.0 * jax.random.normal(key, (2, 5, n, 16))
    fast = mhc_coefficients(params, x, cfg, project_first=True)
    direct = mhc_coefficients(params, x, cfg, project_first=False)
    for a, b in zip(fast, direct, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_shapes_and_fp32_from_bf16():
    cfg = MHCConfig(n_streams=4)
    params, key = random_params(4, 8)
    x = jax.random.normal(key, (2, 3, 4, 8)).astype(jnp.bfloat16)
    h_pre, h_post, h_res = mhc_coefficients(params, x, cfg)
    assert h_pre.shape == h_post.shape == (2, 3, 4) and h_res.shape == (2, 3, 4, 4)
    assert h_pre.dtype == h_post.dtype == h_res.dtype == jnp.float32
    x_new, aux = mhc_apply(x, make_sublayer(8)[0], (h_pre, h_post, h_res))
    assert x_new.shape == x.shape and x_new.dtype == jnp.bfloat16 and aux == {"s": 1}


@pytest.mark.parametrize("residual,variant", [("mhc", "paper"), ("mhc", "v4"), ("hc", "paper")])
def test_update_matches_numpy(residual, variant):
    n, c = 4, 7  # odd C
    # the plain iteration, as coeffs_numpy runs it (the Newton polish: test_sinkhorn_convergence)
    cfg = MHCConfig(
        n_streams=n, residual=residual, sinkhorn_variant=variant, sinkhorn_newton_steps=0
    )
    params, key = random_params(n, c, residual, seed=1)
    x = jax.random.normal(key, (2, 3, n, c))
    fn, fn_np = make_sublayer(c)
    coeffs = mhc_coefficients(params, x, cfg)
    x_new, _ = jax.jit(lambda x, co: mhc_apply(x, fn, co))(x, coeffs)

    pre, post, res = coeffs_numpy(params, x, n, residual, variant=variant)
    for got, want in zip(coeffs, (pre, post, res), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    xn = np.asarray(x, np.float64)
    y = fn_np(np.einsum("btn,btnc->btc", pre, xn))
    want = np.einsum("btij,btjc->btic", res, xn) + post[..., :, None] * y[..., None, :]
    np.testing.assert_allclose(x_new, want, rtol=1e-5, atol=1e-5)


def test_n1_is_gated_residual_by_hand():
    cfg = MHCConfig(n_streams=1)
    params, key = random_params(1, 6, seed=2)
    x = jax.random.normal(key, (2, 3, 1, 6))
    fn, fn_np = make_sublayer(6)
    h_pre, h_post, h_res = mhc_coefficients(params, x, cfg)
    np.testing.assert_array_equal(h_res, np.ones((2, 3, 1, 1), np.float32))
    assert 0 < float(h_pre.min()) < 1 and 0 < float(h_post.min()) < 2
    x_new, _ = mhc_apply(x, fn, (h_pre, h_post, h_res))
    xn, g_pre, g_post = np.asarray(x, np.float64)[:, :, 0], h_pre[..., :1], h_post[..., :1]
    want = xn + np.asarray(g_post) * fn_np(np.asarray(g_pre) * xn)
    np.testing.assert_allclose(x_new[:, :, 0], want, rtol=1e-5, atol=1e-6)


def test_n1_pinned_gates_is_exactly_plain_residual():
    # H_pre = sigmoid(30) == 1.0 and H_post = 2 sigmoid(0) == 1.0 in float32; alpha = 0.
    cfg = MHCConfig(n_streams=1)
    fn, _ = make_sublayer(6)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 3, 1, 6))
    layer = MHCResidual(cfg, width=6)
    variables = nn.unbox(layer.init(jax.random.PRNGKey(0), x, fn))
    p = dict(variables["params"])
    p["alpha"], p["bias"] = jnp.zeros(3), jnp.array([30.0, 0.0, 0.0])
    x_new, _, h_res = layer.apply({"params": p}, x, fn)
    np.testing.assert_array_equal(h_res, 1.0)
    np.testing.assert_array_equal(x_new[:, :, 0], x[:, :, 0] + fn(x[:, :, 0])[0])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_init_near_identity_and_plain_residual(n):
    cfg = MHCConfig(n_streams=n)
    params = mhc_params_init(jax.random.PRNGKey(4), n, 8, cfg)
    h = jax.random.normal(jax.random.PRNGKey(5), (2, 3, 8))
    x = expand_streams(h, n)
    h_pre, h_post, h_res = mhc_coefficients(params, x, cfg)
    # Static part: diag 0.99 (0.01 spread off-diagonal); the alpha = 0.01 dynamic part moves
    # the logits by ~0.01, the probabilities by far less.
    np.testing.assert_allclose(h_res, np.broadcast_to(np.eye(n), h_res.shape), atol=1.2e-2)
    np.testing.assert_allclose(h_post, 1.0, atol=2e-2)
    np.testing.assert_allclose(h_pre, 1.0 / n if n > 1 else 0.5, atol=2e-2)
    # With the dynamic part off, every stream follows the plain residual h + F(h).
    params["phi"] = jnp.zeros_like(params["phi"])
    fn, _ = make_sublayer(8)
    x_new, _ = mhc_apply(x, fn, mhc_coefficients(params, x, cfg))
    if n > 1:
        plain = h + fn(h)[0]
        np.testing.assert_allclose(x_new, np.broadcast_to(plain[:, :, None], x.shape), atol=1e-5)
        np.testing.assert_allclose(reduce_streams(x_new), n * plain, rtol=1e-5, atol=1e-5)


def test_static_bias_hc():
    b = static_bias(3, "hc")
    np.testing.assert_allclose(b[:3], 1 / 3)
    np.testing.assert_allclose(b[3:6], 1.0)
    np.testing.assert_allclose(b[6:].reshape(3, 3), np.eye(3))


def test_composite_gain():
    eye = [jnp.broadcast_to(jnp.eye(4), (2, 3, 4, 4))] * 8
    g = composite_gain(eye)
    for k in ("forward_amax", "backward_amax", "forward_amax_mean", "backward_amax_mean"):
        np.testing.assert_allclose(g[k], 1.0, rtol=1e-6)
    keys = jax.random.split(jax.random.PRNGKey(6), 24)
    ds = [sinkhorn_knopp(jax.random.normal(k, (2, 3, 4, 4))) for k in keys]
    g = composite_gain(ds)
    assert float(g["forward_amax"]) <= 1 + 1e-5  # "paper" ends on rows: unit row sums
    assert float(g["backward_amax"]) <= 1 + 1e-2
    free = [jnp.eye(4) + 0.5 * jax.random.normal(k, (2, 3, 4, 4)) for k in keys]
    g = composite_gain(free)
    assert float(g["forward_amax"]) > 10 and float(g["backward_amax"]) > 10


def test_layer_params_axes_and_matches_reference():
    cfg = MHCConfig(n_streams=4)
    x = jax.random.normal(jax.random.PRNGKey(7), (2, 3, 4, 8))
    fn, _ = make_sublayer(8)
    layer = MHCResidual(cfg, width=8, name="attn_mhc")
    boxed = layer.init(jax.random.PRNGKey(0), x, fn)
    specs = nn.get_partition_spec(boxed)["params"]
    assert tuple(specs["phi"]) == ("mhc_flat", "mhc_coeff")
    assert tuple(specs["norm_scale"]) == ("mhc_flat",)
    assert tuple(specs["alpha"]) == ("mhc_gates",)
    assert tuple(specs["bias"]) == ("mhc_coeff",)
    params = nn.unbox(boxed)["params"]
    shapes = {k: v.shape for k, v in params.items()}
    assert shapes == {"phi": (32, 24), "norm_scale": (32,), "alpha": (3,), "bias": (24,)}
    np.testing.assert_allclose(params["alpha"], cfg.alpha_init)
    x_new, aux, h_res = jax.jit(lambda p, x: layer.apply({"params": p}, x, fn))(params, x)
    want, _ = mhc_apply(x, fn, mhc_coefficients(params, x, cfg))
    np.testing.assert_allclose(x_new, want, rtol=1e-6, atol=1e-6)
    assert h_res.shape == (2, 3, 4, 4) and aux == {"s": 1}


def test_bad_inputs_raise():
    cfg = MHCConfig(n_streams=4)
    params, _ = random_params(4, 8)
    fn, _ = make_sublayer(8)
    x3 = jnp.zeros((2, 3, 3, 8))
    with pytest.raises(ValueError, match=r"n=4.*\(2, 3, 3, 8\)"):
        mhc_coefficients(params, x3, cfg)
    with pytest.raises(ValueError, match=r"n=4.*\(2, 3, 3, 8\)"):
        mhc_apply(x3, fn, mhc_coefficients(params, jnp.ones((2, 3, 4, 8)), cfg))
    with pytest.raises(ValueError, match=r"\(24, 24\).*\(32, 24\)"):
        mhc_coefficients({**params, "phi": jnp.zeros((24, 24))}, jnp.ones((2, 3, 4, 8)), cfg)
    with pytest.raises(ValueError, match="n_streams=0"):
        mhc_coefficients(params, x3, MHCConfig(n_streams=0))
    with pytest.raises(ValueError, match=r"C=16.*\(2, 3, 4, 8\)"):
        MHCResidual(cfg, width=16).init(jax.random.PRNGKey(0), jnp.ones((2, 3, 4, 8)), fn)
    with pytest.raises(ValueError, match="takes a SinglePassState"):  # wrong state type
        MHCResidual(dataclasses.replace(cfg, form="single_pass"), width=8).init(
            jax.random.PRNGKey(0), jnp.ones((2, 3, 4, 8)), fn
        )
    with pytest.raises(ValueError, match="shape"):
        mhc_apply(
            jnp.ones((2, 3, 4, 8)),
            lambda h: (h[..., :4], None),
            mhc_coefficients(params, jnp.ones((2, 3, 4, 8)), cfg),
        )
