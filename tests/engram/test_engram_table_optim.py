"""Row-sparse table optimizers against their dense references, on skewed and duplicate ids:
rowwise_adagrad equals dense row-wise Adagrad on the whole table; sparse_adam equals Adam run
on each row's own sequence of gradients (optax); sinkhorn_sparse equals the dense
Sinkhorn-balanced update when every row is touched, and carries each row's momentum as the
dense form does; numpy (host tables) equals jax; unread rows and padding ids are never
touched."""

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
    for step, (ids, grads) in enumerate(_batches(5, steps=4), start=1):
        rows, g = _unique_grads(ids, grads)
        hyper = dict(weight_decay=0.01, step=step)  # step: sinkhorn_sparse's decay count
        jt, js = table_optim.sparse_update(kind, jt, js, rows, g, 0.02, **hyper)
        nt, ns = table_optim.sparse_update(
            kind, nt, ns, np.asarray(rows), np.asarray(g), 0.02, xp=np, **hyper
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


# ------------------------------------------------------------------ sinkhorn_sparse


def test_sinkhorn_sparse_with_every_row_touched_is_the_dense_update():
    """Every row read every step: the row-sparse form is the dense optax form (Nesterov
    momentum, balance over all rows) at lr x gamma."""
    from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balanced_momentum

    rng = np.random.default_rng(7)
    table0 = rng.normal(size=(R, C)).astype(np.float32)
    tx = sinkhorn_balanced_momentum(0.9)
    dense, dense_state = jnp.asarray(table0), tx.init(jnp.asarray(table0))
    sparse, state = jnp.asarray(table0), table_optim.init_state("sinkhorn_sparse", R, C)
    for step in range(1, 5):
        g = jnp.asarray(rng.normal(size=(R, C)) * rng.lognormal(0, 1, (R, 1)), jnp.float32)
        u, dense_state = tx.update(g, dense_state, dense)
        dense = dense - 0.05 * SINKHORN_GAMMA * u
        sparse, state = table_optim.sparse_update(
            "sinkhorn_sparse", sparse, state, jnp.arange(R), g, 0.05, momentum=0.9, step=step
        )
    np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["m"], dense_state[0].trace, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state["s"]) == 4)


def test_sinkhorn_sparse_decays_a_row_by_its_skipped_steps_and_leaves_others_alone():
    """A row read at steps 1 and 4 enters step 4 with mu^2 of its step-1 momentum (steps 2
    and 3 had no gradient for it), as the dense trace has it; rows never read, and their
    state, stay bit-identical; the lazy alternative (no decay) is a different value."""
    rng = np.random.default_rng(8)
    table0 = rng.normal(size=(R, C)).astype(np.float32)
    table, state = jnp.asarray(table0), table_optim.init_state("sinkhorn_sparse", R, C)
    reads = {1: [0, 3, 5], 2: [3, 6], 3: [6, 9], 4: [0, 3]}
    grads = {s: rng.normal(size=(len(r), C)).astype(np.float32) for s, r in reads.items()}
    for s, rows in reads.items():
        table, state = table_optim.sparse_update(
            "sinkhorn_sparse", table, state, jnp.asarray(rows), jnp.asarray(grads[s]), 0.1,
            momentum=0.9, step=s,
        )  # fmt: skip
    m1 = grads[1][0]  # row 0's momentum after step 1 (from zero)
    want = 0.9 * (0.9**2 * m1) + grads[4][0]  # decayed over steps 2, 3, then step 4
    np.testing.assert_allclose(state["m"][0], want, rtol=1e-6)
    lazy = 0.9 * m1 + grads[4][0]
    assert not np.allclose(state["m"][0], lazy, rtol=1e-3)
    assert np.asarray(state["s"])[[0, 3, 5, 6, 9], 0].tolist() == [4, 4, 1, 3, 3]
    never = np.setdiff1d(np.arange(R), [0, 3, 5, 6, 9])
    np.testing.assert_array_equal(np.asarray(table)[never], table0[never])
    assert not np.any(np.asarray(state["m"])[never]) and not np.any(np.asarray(state["s"])[never])


def test_sinkhorn_sparse_padding_rows_take_no_part():
    """Fill ids (R) of a fixed-size unique: no row is written, and the touched rows' update
    is the one without them."""
    table, state = jnp.ones((R, C)), table_optim.init_state("sinkhorn_sparse", R, C)
    g = jnp.asarray(np.random.default_rng(9).normal(size=(3, C)), jnp.float32)
    padded_rows = jnp.asarray([2, 4, 8, R, R])
    padded_g = jnp.concatenate([g, jnp.full((2, C), 5.0)])
    a, sa = table_optim.sparse_update(
        "sinkhorn_sparse", table, state, padded_rows, padded_g, 0.1, step=1
    )
    b, sb = table_optim.sparse_update(
        "sinkhorn_sparse", table, state, jnp.asarray([2, 4, 8]), g, 0.1, step=1
    )
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa["m"], sb["m"])


def test_sinkhorn_state_is_one_buffer_and_needs_the_step():
    assert table_optim.state_bytes("sinkhorn_sparse", 1000, 64) == 1000 * (4 * 64 + 4)
    assert table_optim.state_bytes("sinkhorn", 1000, 64) == 1000 * 64 * 4  # 1x, Adam's 2x
    with pytest.raises(ValueError, match="'sinkhorn' is not row-sparse"):
        table_optim.init_state("sinkhorn", 4, 2)
    t, s = jnp.zeros((4, 2)), table_optim.init_state("sinkhorn_sparse", 4, 2)
    with pytest.raises(ValueError, match="sinkhorn_sparse needs the step"):
        table_optim.sparse_update("sinkhorn_sparse", t, s, jnp.arange(2), jnp.ones((2, 2)), 0.1)
