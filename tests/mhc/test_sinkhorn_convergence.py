"""The Newton-polished Sinkhorn projection (the default, `newton_steps=4`): rows and columns
sum to 1 within 1e-5 at the coefficient ranges mHC starts from and trains into, where the
plain 20 iterations do not (the negative control); its implicit gradient equals autodiff
through the polished loop and the converged plain iteration; legacy configs keep 0."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.config import get_config
from v41jax.config.text import from_dict, to_dict
from v41jax.mhc import MHCConfig
from v41jax.mhc.reference import mhc_coefficients, mhc_params_init, static_bias
from v41jax.mhc.sinkhorn import NEWTON_STEPS, sinkhorn_knopp, sinkhorn_knopp_unrolled
from v41jax.train.resume import run_identity

TOL = 1e-5


def _sums_error(m) -> tuple[float, float]:
    m = np.asarray(m, np.float64)
    return float(np.abs(m.sum(-1) - 1).max()), float(np.abs(m.sum(-2) - 1).max())


def _h_res(alpha_init: float, newton_steps: int, variant: str, n: int = 4, seed: int = 0):
    """H_res of mhc_coefficients on random streams [2, 257, n, 64] at init."""
    cfg = MHCConfig(
        n_streams=n, alpha_init=alpha_init, sinkhorn_variant=variant,
        sinkhorn_newton_steps=newton_steps,
    )  # fmt: skip
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = mhc_params_init(k1, n, 64, cfg)
    x = jax.random.normal(k2, (2, 257, n, 64))
    return mhc_coefficients(params, x, cfg)[2]


@pytest.mark.parametrize("variant", ["paper", "v4"])
@pytest.mark.parametrize("alpha_init", [0.01, 0.1])
def test_polished_h_res_is_doubly_stochastic_to_1e5_where_plain_is_not(alpha_init, variant):
    rows, cols = _sums_error(_h_res(alpha_init, NEWTON_STEPS, variant))
    assert rows < TOL and cols < TOL, (rows, cols)
    # negative control: the plain 20 iterations miss on the axis they do not end on
    plain = _sums_error(_h_res(alpha_init, 0, variant))
    assert max(plain) > 10 * TOL, plain


@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("scale", [0.01, 0.1, 1.0])
def test_polish_converges_around_the_static_bias_for_every_n(n, scale):
    """Trained coefficients move away from init: the static bias plus scale x N(0, 1)."""
    b = static_bias(n)[2 * n :].reshape(n, n)
    logits = b + scale * jax.random.normal(jax.random.PRNGKey(n), (4096, n, n))
    rows, cols = _sums_error(sinkhorn_knopp(logits))
    assert rows < TOL and cols < TOL, (n, scale, rows, cols)


def test_damping_never_makes_a_spiky_matrix_worse():
    """Logits of 3 N(0, 1) (entries over e^18 apart): undamped Newton diverges here; the
    damped polish only accepts steps that lower the residual, so it is never worse than
    the plain iteration, and it is finite."""
    b = static_bias(4)[8:].reshape(4, 4)
    logits = b + 3.0 * jax.random.normal(jax.random.PRNGKey(0), (4096, 4, 4))
    plain = np.asarray(sinkhorn_knopp(logits, 20, "paper", 0), np.float64)
    polished = np.asarray(sinkhorn_knopp(logits, 20, "paper", 8), np.float64)
    assert np.isfinite(polished).all() and (polished >= 0).all()
    err = lambda m: np.abs(m.sum(-2) - 1).max(-1)  # per matrix, columns (rows are exact)
    assert (err(polished) <= err(plain) + 1e-6).all()
    assert np.median(err(polished)) < TOL < np.median(err(plain))


def _numpy_converged(logits: np.ndarray, variant: str) -> np.ndarray:
    """float64 Sinkhorn run until both sums are within 1e-12 (the projection itself)."""
    z = logits.astype(np.float64)
    if variant == "paper":
        m = np.exp(z - z.max(axis=(-2, -1), keepdims=True))
    else:
        e = np.exp(z - z.max(-1, keepdims=True))
        m = e / e.sum(-1, keepdims=True) + 1e-6
    for _ in range(200_000):
        m = m / m.sum(-2, keepdims=True)
        m = m / m.sum(-1, keepdims=True)
        if np.abs(m.sum(-2) - 1).max() < 1e-12:
            break
    return m


@pytest.mark.parametrize("variant", ["paper", "v4"])
def test_polished_values_equal_the_converged_projection(variant):
    b = np.asarray(static_bias(4)[8:].reshape(4, 4))
    logits = b + 0.1 * np.asarray(jax.random.normal(jax.random.PRNGKey(1), (64, 4, 4)))
    want = _numpy_converged(logits, variant)
    np.testing.assert_allclose(sinkhorn_knopp(jnp.asarray(logits), 20, variant), want, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "v4"])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_implicit_gradient_equals_autodiff_of_the_polished_and_the_converged_loop(variant, scale):
    b = static_bias(4)[8:].reshape(4, 4)
    logits = b + scale * jax.random.normal(jax.random.PRNGKey(2), (16, 4, 4))
    w = jax.random.normal(jax.random.PRNGKey(3), (16, 4, 4))
    loss = lambda fn, *a: lambda z: jnp.sum(fn(z, *a) * w)
    got = jax.jit(jax.grad(loss(sinkhorn_knopp, 20, variant)))(logits)
    through_newton = jax.grad(loss(sinkhorn_knopp_unrolled, 20, variant))(logits)
    converged = jax.jit(jax.grad(loss(sinkhorn_knopp, 3000, variant, 0)))(logits)
    top = float(jnp.abs(got).max())
    assert top > 1e-3
    np.testing.assert_allclose(got, through_newton, atol=1e-4 * top)
    np.testing.assert_allclose(got, converged, atol=1e-4 * top)
    # negative control: the 20-iteration loop's gradient is not the projection's
    short = jax.grad(loss(sinkhorn_knopp_unrolled, 20, variant, 0))(logits)
    assert float(jnp.abs(short - converged).max()) > 1e-3 * top


def test_bf16_logits_get_a_bf16_cotangent():
    logits = (static_bias(4)[8:].reshape(4, 4) + 0.1).astype(jnp.bfloat16)[None]
    g = jax.grad(lambda z: jnp.sum(sinkhorn_knopp(z) * jnp.arange(16.0).reshape(4, 4)))(logits)
    assert g.dtype == jnp.bfloat16 and bool(jnp.isfinite(g.astype(jnp.float32)).all())


def test_configs_saved_before_the_polish_load_the_plain_iteration():
    """Old runs keep their numerics (and their run identity); new runs get the polish."""
    cfg = get_config("1b-mhc")
    assert cfg.model.mhc.sinkhorn_newton_steps == NEWTON_STEPS
    saved = to_dict(cfg)
    del saved["model"]["mhc"]["sinkhorn_newton_steps"]  # written before the field existed
    old = from_dict(type(cfg), saved)
    assert old.model.mhc.sinkhorn_newton_steps == 0
    assert run_identity(old) == "583c55ec9a0ed241"  # 1b-mhc's hash before the field
    assert run_identity(cfg) != run_identity(old)
    assert from_dict(type(cfg), to_dict(cfg)) == cfg  # a saved new config round-trips
    # without mHC the field means nothing: a saved plain run resumes under today's default
    plain = get_config("tiny")
    saved = to_dict(plain)
    del saved["model"]["mhc"]["sinkhorn_newton_steps"]
    assert from_dict(type(plain), saved) == plain
    with pytest.raises(ValueError, match="sinkhorn_newton_steps=-2"):
        dataclasses.replace(cfg.model.mhc, sinkhorn_newton_steps=-2)


def test_the_sums_after_1000_training_steps_are_within_1e5():
    """experiments/mhc_stability/sinkhorn_sums.py (committed results/sinkhorn_sums.json):
    every sub-layer of the `mhc` arm trained 1,000 steps with the polish, and the same
    layers at init (alpha_init 0.01, 0.1), on random streams: polished rows and columns
    within 1e-5; the plain 20 iterations on the same params miss at init."""
    import json
    import pathlib

    path = (
        pathlib.Path(__file__).parents[2] / "experiments/mhc_stability/results/sinkhorn_sums.json"
    )
    result = json.loads(path.read_text())
    assert result["trained"]["step"] == 1000 and result["trained"]["sublayers"] == 16
    for case in ("trained", "init_alpha_0.01", "init_alpha_0.1"):
        polished = result[case]["polished"]
        assert polished["rows"] < TOL and polished["cols"] < TOL, (case, polished)
    for case in ("init_alpha_0.01", "init_alpha_0.1"):
        assert result[case]["plain_20"]["cols"] > 10 * TOL, result[case]
