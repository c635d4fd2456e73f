"""Row-sparse table optimizers against their dense references, on skewed and duplicate ids:
rowwise_adagrad equals dense row-wise Adagrad on the whole table; sparse_adam equals Adam run
on each row's own sequence of gradients (optax); numpy (host tables) equals jax; unread rows
and padding ids are never touched."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from v41jax.engram import table_optim

R, C = 37, 5  # odd sizes


def _batches(seed, steps=6, n=40):
    """Zipf-skewed ids with many duplicates (and rows never read), per-occurrence grads."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.3, n) - 1, R - 1)
        out.append((ids, rng.normal(size=(n, C)).astype(np.float32)))
    return out


def _unique_grads(ids, grads):
    rows, slots = table_optim.unique_rows(jnp.asarray(ids), R)
    g = jax.ops.segment_sum(jnp.asarray(grads), slots, num_segments=rows.shape[0])
    return rows, g


def test_unique_rows_pads_with_the_fill_value():
    ids = jnp.asarray([[3, 1, 3], [7, 1, 1]])
    rows, slots = table_optim.unique_rows(ids, 10)
    assert rows.tolist() == [1, 3, 7, 10, 10, 10]
    np.testing.assert_array_equal(rows[slots], ids)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_rowwise_adagrad_equals_dense_rowwise_adagrad(wd):
    table0 = np.random.default_rng(0).normal(size=(R, C)).astype(np.float32)
    table, state = jnp.asarray(table0), table_optim.init_state("rowwise_adagrad", R, C)
    dense, acc = table0.astype(np.float64), np.zeros((R, 1))
    touched = np.zeros(R, bool)
    lr, eps = 0.05, 1e-8
    for ids, grads in _batches(1):
        rows, g = _unique_grads(ids, grads)
        table, state = table_optim.sparse_update(
            "rowwise_adagrad", table, state, rows, g, lr, eps=eps, weight_decay=wd
        )
        full = np.zeros((R, C))
        np.add.at(full, ids, grads)
        read = np.zeros(R, bool)
        read[ids] = True
        acc += (full**2).mean(-1, keepdims=True)
        # dense row-wise Adagrad; decoupled decay only where the row was read (a row that
        # was never read has no gradient and, in the sparse rule, no decay either)
        step = full / (np.sqrt(acc) + eps) + wd * dense
        dense = np.where(read[:, None], dense - lr * step, dense)
        touched |= read
    np.testing.assert_allclose(np.asarray(table), dense, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(table)[~touched], table0[~touched])
    assert (~touched).any() and touched.sum() > 3


def test_sparse_adam_is_adam_on_each_rows_own_gradients():
    table0 = np.random.default_rng(2).normal(size=(R, C)).astype(np.float32)
    table, state = jnp.asarray(table0), table_optim.init_state("sparse_adam", R, C)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.05
    ref = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    rows_ref = {r: (jnp.asarray(table0[r]), ref.init(jnp.asarray(table0[r]))) for r in range(R)}
    for ids, grads in _batches(3):
        rows, g = _unique_grads(ids, grads)
        table, state = table_optim.sparse_update(
            "sparse_adam", table, state, rows, g, lr, b1=b1, b2=b2, eps=eps, weight_decay=wd
        )
        for r, gr in zip(np.asarray(rows), np.asarray(g), strict=True):
            if r < R:
                p, s = rows_ref[r]
                u, s = ref.update(jnp.asarray(gr), s, p)
                rows_ref[r] = (optax.apply_updates(p, u), s)
    expect = np.stack([np.asarray(rows_ref[r][0]) for r in range(R)])
    np.testing.assert_allclose(np.asarray(table), expect, rtol=1e-5, atol=1e-6)
    counts = np.asarray(state["k"])[:, 0]
    seen = np.zeros(R, int)
    for ids, _ in _batches(3):
        seen[np.unique(ids)] += 1
    np.testing.assert_array_equal(counts, seen)  # each row's own step count


@pytest.mark.parametrize("kind", table_optim.SPARSE_TABLE_OPTIMIZERS)
def test_numpy_host_form_equals_jax(kind):
    table0 = np.random.default_rng(4).normal(size=(R, C)).astype(np.float32)
    jt, js = jnp.asarray(table0), table_optim.init_state(kind, R, C)
    nt, ns = table0.copy(), table_optim.init_state(kind, R, C, xp=np)
    for ids, grads in _batches(5, steps=4):
        rows, g = _unique_grads(ids, grads)
        jt, js = table_optim.sparse_update(kind, jt, js, rows, g, 0.02, weight_decay=0.01)
        nt, ns = table_optim.sparse_update(
            kind, nt, ns, np.asarray(rows), np.asarray(g), 0.02, weight_decay=0.01, xp=np
        )
    np.testing.assert_allclose(nt, np.asarray(jt), rtol=1e-6, atol=1e-6)
    for name in ns:
        np.testing.assert_allclose(ns[name], np.asarray(js[name]), rtol=1e-6, atol=1e-7)


def test_state_bytes_and_errors():
    assert table_optim.state_bytes("rowwise_adagrad", 1000, 64) == 4000  # 1/C of the table
    assert table_optim.state_bytes("sparse_adam", 1000, 64) == 1000 * (8 * 64 + 4)
    assert table_optim.state_bytes("adam", 1000, 64) == 2 * 1000 * 64 * 4
    with pytest.raises(ValueError, match="'adam' is not row-sparse"):
        table_optim.init_state("adam", 4, 2)
    with pytest.raises(ValueError, match="not in"):
        table_optim.state_bytes("sgd", 4, 2)
    t, s = jnp.zeros((4, 2)), table_optim.init_state("sparse_adam", 4, 2)
    with pytest.raises(ValueError, match=r"grads shape \(3, 3\)"):
        table_optim.sparse_update("sparse_adam", t, s, jnp.arange(3), jnp.zeros((3, 3)), 0.1)
