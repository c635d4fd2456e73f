"""The Sinkhorn balance of an update matrix (V4.1's table optimizer) against a plain loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from v41jax.ops.sinkhorn_balance import sinkhorn_balance, sinkhorn_balanced_momentum


def reference(m, valid=None, tau=1e-3, iters=11):
    """Row by row, column by column, in float64."""
    u = np.array(m, np.float64)
    rows, cols = u.shape
    valid = np.ones(rows, bool) if valid is None else np.asarray(valid)
    u[~valid] = 0
    norms = [np.sqrt(sum(x * x for x in u[r])) for r in range(rows)]
    mean = sum(norms) / max(valid.sum(), 1)
    active = [bool(valid[r] and norms[r] > tau * mean) for r in range(rows)]
    for r in range(rows):
        if not active[r]:
            u[r] = 0
    for k in range(1, iters + 1):
        if k % 2:
            for r in range(rows):
                n = np.sqrt((u[r] ** 2).sum())
                u[r] = u[r] / n if n > 0 else 0
        else:
            for c in range(cols):
                n = np.sqrt((u[:, c] ** 2).sum())
                u[:, c] = u[:, c] / n if n > 0 else 0
    entries = sum(active) * cols
    rms = np.sqrt((u**2).sum() / max(entries, 1))
    return u / rms if rms > 0 else u


def skewed(rows, cols, seed):
    """Rows of very different scales (a Zipf-like table gradient), a few near zero."""
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((rows, cols)) * rng.lognormal(0, 2, (rows, 1))
    m[rng.random(rows) < 0.2] *= 1e-7  # inactive rows
    m[:, 0] *= 30  # a dominant feature
    return m.astype(np.float32)


@pytest.mark.parametrize("rows, cols, iters", [(37, 13, 11), (5, 64, 11), (64, 3, 4), (1, 7, 11)])
def test_equals_the_plain_loop(rows, cols, iters):
    m = skewed(rows, cols, rows)
    want = reference(m, iters=iters)
    np.testing.assert_allclose(sinkhorn_balance(jnp.asarray(m), iters=iters), want, atol=2e-5)
    np.testing.assert_allclose(sinkhorn_balance(m, iters=iters, xp=np), want, atol=2e-5)


def spread(u):
    """Range of the column norms over their mean: 0 when every feature carries the same."""
    norms = np.linalg.norm(u, axis=0)
    return np.ptp(norms) / norms.mean()


def test_rows_move_equally_and_columns_balance():
    """K odd ends on rows: every active row has norm sqrt(D); K = 11 leaves the column norms
    nearly equal, where one row step (K = 1, the negative control) leaves the dominant feature
    dominant."""
    m = skewed(200, 16, 1)
    u = np.asarray(sinkhorn_balance(jnp.asarray(m)))
    active = np.linalg.norm(u, axis=1) > 0
    np.testing.assert_allclose(np.linalg.norm(u[active], axis=1), np.sqrt(16), rtol=1e-5)
    assert np.sqrt((u[active] ** 2).mean()) == pytest.approx(1.0, rel=1e-5)
    assert spread(u) < 0.02
    assert spread(np.asarray(sinkhorn_balance(jnp.asarray(m), iters=1))) > 0.5


def test_inactive_rows_get_no_update():
    m = skewed(50, 8, 2)
    m[3] = 0
    m[7] *= 0
    u = np.asarray(sinkhorn_balance(jnp.asarray(m)))
    norms = np.linalg.norm(m.astype(np.float64), axis=1)
    inactive = norms <= 1e-3 * norms.mean()
    assert inactive[3] and inactive[7] and inactive.sum() >= 3
    assert np.all(u[inactive] == 0) and np.all(np.linalg.norm(u[~inactive], axis=1) > 0)


def test_invalid_rows_take_no_part():
    """A row-sparse step's padding rows: zero out, and the valid rows balance as if alone."""
    m = skewed(30, 6, 3)
    valid = np.ones(30, bool)
    valid[[0, 11, 29]] = False
    u = np.asarray(sinkhorn_balance(jnp.asarray(m), jnp.asarray(valid)))
    assert np.all(u[~valid] == 0)
    np.testing.assert_allclose(u[valid], sinkhorn_balance(jnp.asarray(m[valid])), atol=1e-6)
    np.testing.assert_allclose(u, reference(m, valid), atol=2e-5)


def test_zero_matrix_and_no_valid_rows_give_zeros_not_nans():
    z = sinkhorn_balance(jnp.zeros((4, 3)))
    assert np.all(np.asarray(z) == 0)
    m = jnp.ones((4, 3))
    assert np.all(np.asarray(sinkhorn_balance(m, jnp.zeros(4, bool))) == 0)


def test_jit_and_grad_free():
    m = jnp.asarray(skewed(16, 5, 4))
    np.testing.assert_allclose(jax.jit(sinkhorn_balance)(m), sinkhorn_balance(m), atol=1e-6)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sinkhorn_balance(jnp.ones((2, 3, 4))), r"\[rows, features\].*\(2, 3, 4\)"),
        (lambda: sinkhorn_balance(jnp.ones((2, 3)), iters=-1), "iters=-1"),
        (lambda: sinkhorn_balance(jnp.ones((2, 3)), tau=-0.5), "tau=-0.5"),
        (lambda: sinkhorn_balance(jnp.ones((2, 3)), jnp.ones(3, bool)), r"row_valid.*\(2,\)"),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_optax_transform_is_nesterov_momentum_then_balance():
    params = {"table": jnp.zeros((12, 5)), "head": jnp.zeros((5, 12))}
    tx = sinkhorn_balanced_momentum(0.9, rows_last={"table": False, "head": True})
    state = tx.init(params)
    assert optax.tree.size(state) == optax.tree.size(params)  # one buffer: 1x, not Adam's 2x
    rng = np.random.default_rng(5)
    trace = {k: np.zeros(v.shape) for k, v in params.items()}
    for _ in range(3):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        for k in params:
            trace[k] = 0.9 * trace[k] + g[k]
            nesterov = g[k] + 0.9 * trace[k]
            want = reference(nesterov) if k == "table" else reference(nesterov.T).T
            np.testing.assert_allclose(updates[k], want, atol=3e-5)


def test_optax_transform_refuses_non_matrices():
    tx = sinkhorn_balanced_momentum()
    params = {"bias": jnp.zeros(4)}
    with pytest.raises(ValueError, match=r"2-D parameters, got \(4,\)"):
        tx.update(params, tx.init(params), params)
