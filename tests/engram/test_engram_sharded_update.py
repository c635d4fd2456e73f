"""Row-sparse updates of a row-sharded table on 8 fake CPU devices, delivered by all-to-all,
equal the unsharded sparse update: rows read, the owners' row gradients (every source's and
every capacity round's share summed before the non-linear update) and the updated table and
optimizer state. Skewed ids with a tiny capacity factor force several exchange rounds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.config import MeshConfig
from v41jax.engram import table_optim
from v41jax.engram.sharded import DEFAULT_BATCH_AXES, DEFAULT_ROW_AXES, padded_rows
from v41jax.engram.sharded_update import (
    owner_gradients,
    row_shard_plan,
    sharded_rows,
    sharded_sparse_update,
)
from v41jax.sharding import make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
R, C, B, T, H = padded_rows(1009, 8), 8, 8, 5, 3


@functools.cache
def mesh_of(shape):
    return make_mesh(MeshConfig(*shape))


def plan_of(shape, cf=1.25):
    plan = row_shard_plan(mesh_of(shape), (R, C), B, DEFAULT_ROW_AXES, DEFAULT_BATCH_AXES, cf)
    assert plan is not None
    return plan


def skewed_ids(seed, hot_owner=None):
    """Zipf ids (many duplicates); with hot_owner, every id falls in that owner's shard."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.3, size=(B, T, H)) * 7919) % R
    if hot_owner is not None:
        ids = hot_owner * (R // 8) + ids % (R // 8)
    return jnp.asarray(ids, jnp.int32)


def dense_gradient(ids, g):
    """The unsharded table gradient: sum of each position's cotangent into its row."""
    return jax.ops.segment_sum(g.reshape(-1, C), ids.reshape(-1), num_segments=R)


def scattered(rows_SK, grads_SKxC):
    """Owners' (local rows, grads) back into one [R, C] array (padding rows dropped)."""
    rows, grads = np.asarray(rows_SK).reshape(8, -1), np.asarray(grads_SKxC).reshape(8, -1, C)
    out, seen = np.zeros((R, C), np.float32), set()
    for s in range(8):
        keep = rows[s] < R // 8
        glob = s * (R // 8) + rows[s][keep]
        assert not seen & set(glob.tolist()) and len(set(glob.tolist())) == len(glob)
        seen |= set(glob.tolist())
        out[glob] = grads[s][keep]
    return out, seen


# (8,1,1): rows and batch over data; (2,2,2): tensor is a replica axis of the batch.
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
@pytest.mark.parametrize("cf,hot", [(1.25, None), (0.05, 3)])
def test_owner_gradients_are_the_dense_gradient(shape, cf, hot):
    plan = plan_of(shape, cf)
    table = jax.random.normal(jax.random.key(0), (R, C))
    ids = skewed_ids(1, hot)
    g = jnp.round(4 * jax.random.normal(jax.random.key(2), (B, T, H * C)))  # exact sums
    e = jax.jit(functools.partial(sharded_rows, plan))(table, ids)
    np.testing.assert_array_equal(e, table[ids].reshape(B, T, H * C))
    rows, grads = jax.jit(functools.partial(owner_gradients, plan))(ids, g)
    got, seen = scattered(rows, grads)
    assert seen == set(np.unique(np.asarray(ids)).tolist())  # exactly the rows read
    np.testing.assert_array_equal(got, dense_gradient(ids, g))


@pytest.mark.parametrize("kind", ["sparse_adam", "rowwise_adagrad", "sinkhorn_sparse"])
def test_sharded_update_equals_the_unsharded_update(kind):
    plan = plan_of((2, 2, 2), cf=0.05)  # several rounds
    hyper = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)
    table = jax.random.normal(jax.random.key(3), (R, C))
    state = table_optim.init_state(kind, R, C)
    ref_table, ref_state = table, state

    @jax.jit
    def sharded_step(table, state, ids, g, step):
        rows, grads = owner_gradients(plan, ids, g)
        return sharded_sparse_update(plan, kind, table, state, rows, grads, 0.1, step=step, **hyper)

    for step in range(3):  # later steps see non-zero moments and per-row step counts
        ids = skewed_ids(10 + step, hot_owner=step % 2 * 5 or None)
        g = jax.random.normal(jax.random.key(20 + step), (B, T, H * C))
        table, state = sharded_step(table, state, ids, g, step + 1)
        rows, slots = table_optim.unique_rows(ids, R)
        g_rows = jax.ops.segment_sum(g.reshape(-1, C), slots.reshape(-1), num_segments=rows.size)
        ref_table, ref_state = table_optim.sparse_update(
            kind, ref_table, ref_state, rows, g_rows, 0.1, step=step + 1, **hyper
        )
    np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-6)
    for name in ref_state:
        np.testing.assert_allclose(state[name], ref_state[name], rtol=1e-6, atol=1e-7)
    assert table.sharding.spec[0] and state[next(iter(state))].sharding.spec[0]  # still split


def test_plan_only_where_the_table_is_split_over_every_device():
    axes = (DEFAULT_ROW_AXES, DEFAULT_BATCH_AXES)
    assert row_shard_plan(mesh_of((1, 1, 1)), (R, C), B, *axes) is None  # one shard
    assert row_shard_plan(mesh_of((8, 1, 1)), (R + 1, C), B, *axes) is None  # uneven rows
    assert row_shard_plan(mesh_of((8, 1, 1)), (R, C), 4, *axes) is None  # batch 4 on 8
    # rows over fsdp only: the table would be replicated over data
    assert row_shard_plan(mesh_of((2, 4, 1)), (R, C), B, ("fsdp",), DEFAULT_BATCH_AXES) is None
    plan = row_shard_plan(mesh_of((2, 4, 1)), (R, C), B, *axes)
    assert plan.num_row_shards == 8 and plan.rows_per_shard == R // 8


def test_bad_shapes_are_named():
    plan = plan_of((8, 1, 1))
    ids = skewed_ids(0)
    with pytest.raises(ValueError, match=r"ids must be int \[B, T, H\]"):
        owner_gradients(plan, ids.astype(jnp.float32), jnp.zeros((B, T, H * C)))
    with pytest.raises(ValueError, match=r"rows \(8, 5, 7\) must be \[B, T, H\*C\]"):
        owner_gradients(plan, ids, jnp.zeros((B, T, 7)))
    with pytest.raises(ValueError, match="not row-sparse"):
        sharded_sparse_update(plan, "adam", jnp.zeros((R, C)), {}, None, None, 0.1)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_sharded_sparse_step_lowers_for(platform):
    plan = plan_of((2, 2, 2), cf=0.5)
    state = table_optim.init_state("sparse_adam", R, C)

    def step(table, state, ids, g):
        rows, grads = owner_gradients(plan, ids, g)
        return sharded_sparse_update(plan, "sparse_adam", table, state, rows, grads, 0.1)

    args = (jnp.zeros((R, C)), state, skewed_ids(0), jnp.zeros((B, T, H * C)))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "all_to_all" in text
