"""Sinkhorn-Knopp, the plain iteration (newton_steps=0): doubly stochastic output, numpy
parity, recompute-VJP == unrolled autodiff. The Newton polish (the default) is tested in
test_sinkhorn_convergence.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.mhc.sinkhorn import V4_EPS, sinkhorn_knopp, sinkhorn_knopp_unrolled


def sinkhorn_numpy(logits: np.ndarray, num_iters: int, variant: str) -> np.ndarray:
    """Independent float64 implementation of both orderings (module docstring)."""
    z = logits.astype(np.float64)
    if variant == "paper":
        m = np.exp(z - z.max(axis=(-2, -1), keepdims=True))
        for _ in range(num_iters):
            m = m / m.sum(-2, keepdims=True)
            m = m / m.sum(-1, keepdims=True)
        return m
    e = np.exp(z - z.max(-1, keepdims=True))
    m = e / e.sum(-1, keepdims=True) + V4_EPS
    m = m / (m.sum(-2, keepdims=True) + V4_EPS)
    for _ in range(num_iters - 1):
        m = m / (m.sum(-1, keepdims=True) + V4_EPS)
        m = m / (m.sum(-2, keepdims=True) + V4_EPS)
    return m


def _logits(shape, scale=1.0, seed=0, dtype=jnp.float32):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape)).astype(dtype)


@pytest.mark.parametrize("variant", ["paper", "v4"])
def test_doubly_stochastic(variant):
    m = sinkhorn_knopp(_logits((512, 4, 4)), 20, variant, 0)
    assert m.dtype == jnp.float32 and m.shape == (512, 4, 4)
    assert float(m.min()) >= 0.0
    # 20 iterations on N(0, 1) logits converge to ~3e-4 in the worst of 512 matrices; the
    # axis normalised last is exact to float rounding (+ eps for v4).
    last, other = (-1, -2) if variant == "paper" else (-2, -1)
    np.testing.assert_allclose(m.sum(last), 1.0, atol=1e-5)
    np.testing.assert_allclose(m.sum(other), 1.0, atol=2e-3)


@pytest.mark.parametrize("variant", ["paper", "v4"])
@pytest.mark.parametrize("num_iters", [1, 5, 20])
def test_matches_numpy(variant, num_iters):
    logits = _logits((3, 5, 4, 4), scale=2.0, seed=1)
    want = sinkhorn_numpy(np.asarray(logits), num_iters, variant)
    for fn in (sinkhorn_knopp, sinkhorn_knopp_unrolled):
        np.testing.assert_allclose(fn(logits, num_iters, variant, 0), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "v4"])
def test_batch_dims_and_jit(variant):
    logits = _logits((2, 3, 6, 6), seed=2)
    full = jax.jit(sinkhorn_knopp, static_argnums=(1, 2, 3))(logits, 20, variant, 0)
    one = sinkhorn_knopp(logits[1, 2], 20, variant, 0)
    np.testing.assert_allclose(full[1, 2], one, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant", ["paper", "v4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_custom_vjp_equals_unrolled_autodiff(variant, dtype):
    logits = _logits((4, 3, 4, 4), scale=1.5, seed=3, dtype=dtype)
    g = jax.random.normal(jax.random.PRNGKey(4), (4, 3, 4, 4))

    def loss(fn):
        return lambda z: jnp.sum(fn(z, 20, variant, 0) * g)

    got = jax.jit(jax.grad(loss(sinkhorn_knopp)))(logits)
    want = jax.grad(loss(sinkhorn_knopp_unrolled))(logits)  # eager: XLA compiles unrolled slowly
    assert got.dtype == dtype and want.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol * 1e-2
    )
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32)))) > 0


def test_gradient_matches_finite_differences():
    # Independent of both implementations' autodiff: float32 central differences.
    logits = _logits((4, 4), seed=5)
    g = jax.random.normal(jax.random.PRNGKey(6), (4, 4))
    f = jax.jit(lambda z: jnp.sum(sinkhorn_knopp(z, 20, "paper", 0) * g))
    grad = np.asarray(jax.grad(f)(logits))
    h, e = 1e-2, np.zeros((4, 4), np.float32)
    e[1, 2] = h
    fd = (f(logits + e) - f(logits - e)) / (2 * h)
    np.testing.assert_allclose(grad[1, 2], fd, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("variant", ["paper", "v4"])
def test_n1_is_exactly_one(variant):
    logits = _logits((2, 3, 1, 1), scale=10.0, seed=7, dtype=jnp.bfloat16)
    m = sinkhorn_knopp(logits, 20, variant)
    assert m.dtype == jnp.float32
    np.testing.assert_array_equal(m, np.ones((2, 3, 1, 1), np.float32))
    grad = jax.grad(lambda z: jnp.sum(sinkhorn_knopp(z, 20, variant)))(logits)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        sinkhorn_knopp(jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        sinkhorn_knopp(jnp.zeros((4,)))
    with pytest.raises(ValueError, match="'bogus'"):
        sinkhorn_knopp(jnp.zeros((4, 4)), variant="bogus")
    with pytest.raises(ValueError, match="num_iters=0"):
        sinkhorn_knopp(jnp.zeros((4, 4)), num_iters=0)
    with pytest.raises(ValueError, match="newton_steps=-1"):
        sinkhorn_knopp(jnp.zeros((4, 4)), newton_steps=-1)
