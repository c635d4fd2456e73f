"""Single-Pass mHC (lagged pre-mapping): the one-pass stack equals the step-by-step lagged
reference over several sub-layers, forward and gradients, at odd sizes (T=7, C=13)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.mhc.config import MHCConfig
from v41jax.mhc.reference import mhc_coefficients, mhc_params_init
from v41jax.mhc.single_pass import (
    coefficients_from_stats,
    folded_phi,
    single_pass_forward,
    single_pass_forward_reference,
    stream_stats,
)

LAYERS = 3


def _setup(n, c, residual="mhc", seed=0, lead=(2, 7)):
    cfg = MHCConfig(n_streams=n, residual=residual, sinkhorn_iters=10)
    key = jax.random.PRNGKey(seed)
    k_x, k_w, *k_p = jax.random.split(key, 2 + 2 * LAYERS)
    params = []
    for layer in range(LAYERS):
        p = mhc_params_init(k_p[2 * layer], n, c, cfg, phi_std=1.0)
        # Large gates and a random bias, so the dynamic coefficients matter in the test.
        p["alpha"] = jnp.array([0.7, 0.5, 0.9], jnp.float32)
        p["bias"] = p["bias"] + 0.3 * jax.random.normal(k_p[2 * layer + 1], p["bias"].shape)
        p["norm_scale"] = 1.0 + 0.1 * jax.random.normal(k_p[2 * layer + 1], (n * c,))
        params.append(p)
    x0 = jax.random.normal(k_x, (*lead, n, c), jnp.float32)
    weights = [jax.random.normal(k, (c, c)) / np.sqrt(c) for k in jax.random.split(k_w, LAYERS)]
    norm_scales = [1.0 + 0.1 * jnp.cos(jnp.arange(c) + i) for i in range(LAYERS + 1)]
    return cfg, params, x0, weights, norm_scales


def _fns(weights):
    # A stand-in sub-layer: tanh of a linear map (nonlinear, so lag errors would show).
    return [lambda h, w=w: jnp.tanh(h @ w) for w in weights]


def _run(forward, params, x0, weights, norm_scales, cfg, **kw):
    return forward(params, x0, _fns(weights), cfg, norm_scales, **kw)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("residual", ["mhc", "hc"])
def test_stats_give_the_coefficients(n, residual):
    cfg, params, x0, _, _ = _setup(n, 13, residual)
    proj, sumsq = stream_stats(x0, folded_phi(params[0]))
    ours = coefficients_from_stats(params[0], proj, sumsq, cfg)
    want = mhc_coefficients(params[0], x0, cfg, project_first=False)
    for a, b in zip(ours, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [3, 4])
def test_forward_equals_lagged_reference(n):
    cfg, params, x0, weights, scales = _setup(n, 13)
    x_l, h_l = _run(single_pass_forward, params, x0, weights, scales, cfg)
    x_r, h_r = _run(single_pass_forward_reference, params, x0, weights, scales, cfg)
    assert x_l.shape == x0.shape and h_l.shape == x0.shape[:-2] + (13,)
    np.testing.assert_allclose(x_l, x_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(h_l, h_r, rtol=1e-4, atol=1e-4)


def test_forward_without_norms_and_bf16():
    cfg, params, x0, weights, _ = _setup(4, 13, seed=1)
    x0 = x0.astype(jnp.bfloat16)
    x_l, h_l = _run(single_pass_forward, params, x0, weights, None, cfg)
    x_r, h_r = _run(single_pass_forward_reference, params, x0, weights, None, cfg)
    assert x_l.dtype == jnp.bfloat16 and h_l.dtype == jnp.bfloat16
    as32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(as32(x_l), as32(x_r), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(as32(h_l), as32(h_r), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("n", [3, 4])
def test_gradients_equal_lagged_reference(n):
    cfg, params, x0, weights, scales = _setup(n, 13, seed=2)

    def loss(forward, params, x0, weights, scales):
        x_l, h_l = _run(forward, params, x0, weights, scales, cfg)
        return jnp.sum(jnp.sin(x_l)) + jnp.sum(h_l**2)

    argnums = (0, 1, 2, 3)
    g_ours = jax.grad(lambda *a: loss(single_pass_forward, *a), argnums)(
        params, x0, weights, scales
    )
    g_ref = jax.grad(lambda *a: loss(single_pass_forward_reference, *a), argnums)(
        params, x0, weights, scales
    )
    flat_o, tree_o = jax.tree.flatten(g_ours)
    flat_r, tree_r = jax.tree.flatten(g_ref)
    assert tree_o == tree_r
    for a, b in zip(flat_o, flat_r, strict=True):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        np.testing.assert_allclose(a / scale, b / scale, atol=2e-4)


def test_pallas_interpret_stack_equals_xla():
    cfg, params, x0, weights, scales = _setup(4, 13, seed=3, lead=(7,))
    x_p, h_p = _run(
        single_pass_forward, params, x0, weights, scales, cfg, impl="pallas", interpret=True
    )
    x_x, h_x = _run(single_pass_forward, params, x0, weights, scales, cfg)
    np.testing.assert_allclose(x_p, x_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h_p, h_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [8, 3])
def test_pallas_under_a_multi_device_mesh_equals_xla(rows):
    """Under an 8-device mesh the kernel runs per device in a shard_map over the batch axes
    (GSPMD cannot partition a Pallas call); 3 rows do not divide the 8 devices: computed
    whole on each, same values. Forward and gradient."""
    from v41jax import sharding

    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4, 1), sharding.MESH_AXES)
    cfg, params, x0, weights, scales = _setup(4, 13, seed=5, lead=(rows, 5))

    def loss(x0, impl):
        x, h = _run(single_pass_forward, params, x0, weights, scales, cfg, impl=impl,
                    interpret=True)  # fmt: skip
        return jnp.sum(x * x) + jnp.sum(jnp.sin(h)), (x, h)

    want, want_grad = jax.value_and_grad(loss, has_aux=True)(x0, "xla")
    with jax.set_mesh(mesh):
        # the kernel impl goes through a shard_map; the XLA form stays GSPMD's
        assert "shard_map" in str(jax.make_jaxpr(lambda x: loss(x, "pallas"))(x0))
        assert "shard_map" not in str(jax.make_jaxpr(lambda x: loss(x, "xla"))(x0))
        got, got_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
            x0, "pallas"
        )
    for a, b in zip(jax.tree.leaves((got, got_grad)), jax.tree.leaves((want, want_grad)),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_layer0_uses_one_hot_pre_mapping():
    cfg, params, x0, _, scales = _setup(4, 13, seed=4)
    seen = []

    def record(h):
        seen.append(h)
        return jnp.zeros_like(h)

    single_pass_forward(params[:1], x0, [record], cfg, scales[:2])
    x = x0[..., 0, :]
    want = x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * scales[0]
    np.testing.assert_allclose(seen[0], want, rtol=1e-5, atol=1e-5)
    # The other streams do not reach the first sub-layer's input at all.
    single_pass_forward(params[:1], x0.at[..., 1:, :].add(5.0), [record], cfg, scales[:2])
    np.testing.assert_array_equal(seen[1], seen[0])


def test_bad_arguments_raise():
    cfg, params, x0, weights, scales = _setup(4, 13)
    with pytest.raises(ValueError, match="norm_scales needs L \\+ 1"):
        single_pass_forward(params, x0, _fns(weights), cfg, scales[:2])
    with pytest.raises(ValueError, match="params for 2 sub-layers"):
        single_pass_forward(params, x0, _fns(weights)[:2], cfg)
