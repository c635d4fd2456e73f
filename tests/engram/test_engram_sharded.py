"""Row-sharded Engram lookup on 8 fake CPU devices equals the unsharded `table[ids]`.

Outputs are compared bit for bit. Gradients use integer-valued cotangent weights, so every
sum of duplicates is exact in any order and the comparison can be bitwise too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from v41jax.config import MeshConfig
from v41jax.engram.sharded import (
    DEFAULT_ROW_AXES,
    ENGRAM_ROW_AXIS,
    pad_table,
    padded_rows,
    reference_lookup,
    sharded_lookup,
)
from v41jax.engram.sharded_cost import choose_method, lookup_bytes_per_token
from v41jax.sharding import make_mesh

R, E, H, B, T = 1009, 24, 3, 8, 7  # prime rows, padded to 1016 for 8 shards
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]
METHODS = ["all_to_all", "psum"]
SLOW = pytest.mark.slow
# 8-way row sharding over data and over all three axes stay fast; data x fsdp is slow.
MESH_PARAMS = [pytest.param(m, marks=SLOW if m == (2, 4, 1) else ()) for m in MESHES]


@functools.cache
def mesh_of(shape):
    return make_mesh(MeshConfig(*shape))


def make_table(rows=R, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(0), (rows, E)).astype(dtype)


def make_ids(high=R, seed=1):
    ids = np.array(jax.random.randint(jax.random.key(seed), (B, T, H), 0, high))
    ids[0, 0, 0], ids[-1, -1, -1] = high - 1, 0  # last real row and row 0
    ids[:, 3, 1] = 17  # the same id from every batch shard (duplicates across devices)
    ids[::2, 5, 2] = high - 1
    return jnp.asarray(ids, jnp.int32)


def put(mesh, table, ids, row_axes=DEFAULT_ROW_AXES):
    return (
        jax.device_put(table, NamedSharding(mesh, P(row_axes, None))),
        jax.device_put(ids, NamedSharding(mesh, P(("data", "fsdp")))),
    )


def weights(shape):
    """Integer cotangents: duplicate sums are exact in any order."""
    return jnp.round(4 * jax.random.normal(jax.random.key(2), shape))


def check_lookup(mesh, ids, *, row_axes=DEFAULT_ROW_AXES, method="auto", **kw):
    shards = int(np.prod([mesh.shape[a] for a in row_axes]))
    table = pad_table(make_table(), shards)
    w = weights((B, T, H * E))
    table_s, ids_s = put(mesh, table, ids, row_axes)
    lookup = functools.partial(sharded_lookup, mesh=mesh, row_axes=row_axes, method=method, **kw)

    out = jax.jit(lookup)(table_s, ids_s)
    np.testing.assert_array_equal(out, reference_lookup(table, ids))
    assert out.dtype == jnp.float32
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"))), 3)

    grad = jax.jit(jax.grad(lambda tb: jnp.sum(lookup(tb, ids_s) * w)))(table_s)
    grad_ref = jax.grad(lambda tb: jnp.sum(reference_lookup(tb, ids) * w))(table)
    np.testing.assert_array_equal(grad, grad_ref)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, P(row_axes, None)), 2)
    np.testing.assert_array_equal(grad[R:], 0.0)  # padding rows: never addressed
    return out, grad


def test_padding():
    assert padded_rows(1009, 8) == 1016 and padded_rows(1016, 8) == 1016
    table = make_table(dtype=jnp.bfloat16)
    padded = pad_table(table, 8)
    assert padded.shape == (1016, E) and padded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(padded[:R], table)
    np.testing.assert_array_equal(padded[R:], 0)
    assert pad_table(padded, 8) is padded
    assert pad_table(jnp.ones((R,)), 8).shape == (1016,)  # a per-row scale pads alike
    with pytest.raises(ValueError, match="num_shards=0"):
        padded_rows(10, 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", MESH_PARAMS)
def test_outputs_and_grads_equal_unsharded(shape, method):
    check_lookup(mesh_of(shape), make_ids(), method=method)


@pytest.mark.parametrize(
    "row_axes", [("tensor",), ("data", "fsdp"), pytest.param(("fsdp", "tensor"), marks=SLOW)]
)
@pytest.mark.parametrize("method", METHODS)
def test_partial_row_axes_replicate_table_and_sum_grads(row_axes, method):
    check_lookup(mesh_of((2, 2, 2)), make_ids(), row_axes=row_axes, method=method)


def test_random_cotangent_grads_close():
    mesh, ids = mesh_of((2, 2, 2)), make_ids()
    table = pad_table(make_table(), 8)
    w = jax.random.normal(jax.random.key(3), (B, T, H * E))
    grad = jax.jit(jax.grad(lambda tb: jnp.sum(sharded_lookup(tb, ids, mesh) * w)))(table)
    grad_ref = jax.grad(lambda tb: jnp.sum(reference_lookup(tb, ids) * w))(table)
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shape,capacity_factor",
    [  # fast: 8 row shards with the default capacity, and three axes with a tiny one
        pytest.param((8, 1, 1), 1.25, id="shape0-1.25"),
        pytest.param((2, 2, 2), 1.25, id="shape1-1.25", marks=SLOW),
        pytest.param((8, 1, 1), 0.05, id="shape0-0.05", marks=SLOW),
        pytest.param((2, 2, 2), 0.05, id="shape1-0.05"),
    ],
)
def test_skewed_ids_on_one_shard_take_extra_rounds_and_stay_exact(shape, capacity_factor):
    mesh, rows_per_shard = mesh_of(shape), padded_rows(R, 8) // 8
    ids = make_ids(high=rows_per_shard)  # every id is owned by shard 0
    # precondition: the owner gets more distinct ids than one round's capacity
    per_device = ids.reshape(shape[0] * shape[1], -1)
    share = per_device.shape[1] // shape[2]
    capacity = int(np.ceil(capacity_factor * share / 8))
    assert max(len(np.unique(d[:share])) for d in np.asarray(per_device)) > capacity
    check_lookup(mesh, ids, method="all_to_all", capacity_factor=capacity_factor)


def test_every_id_identical():
    ids = jnp.full((B, T, H), R - 1, jnp.int32)
    check_lookup(mesh_of((2, 4, 1)), ids, method="all_to_all", capacity_factor=0.01)


@pytest.mark.parametrize("method", ["all_to_all", "psum", "auto"])
def test_fp8_table_with_row_scale(method):
    mesh, ids = mesh_of((2, 2, 2)), make_ids()
    table = pad_table(make_table(), 8)
    scale = jnp.max(jnp.abs(table), axis=1) / float(jnp.finfo(jnp.float8_e4m3fn).max) + 1e-12
    q = (table / scale[:, None]).astype(jnp.float8_e4m3fn)
    want = (q[ids].astype(jnp.float32) * scale[ids][..., None]).reshape(B, T, H * E)
    run = jax.jit(lambda q, i, s: sharded_lookup(q, i, mesh, method=method, row_scale=s))
    np.testing.assert_array_equal(run(q, ids, scale), want)


def test_bf16_table_gives_f32_output_and_bf16_grads():
    mesh, ids = mesh_of((2, 4, 1)), make_ids()
    table = pad_table(make_table(dtype=jnp.bfloat16), 8)
    out = jax.jit(lambda tb: sharded_lookup(tb, ids, mesh))(table)
    np.testing.assert_array_equal(out, reference_lookup(table, ids))
    grad = jax.jit(jax.grad(lambda tb: jnp.sum(sharded_lookup(tb, ids, mesh))))(table)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(grad, jax.grad(lambda tb: reference_lookup(tb, ids).sum())(table))


def test_all_to_all_moves_rows_without_reductions():
    mesh, ids = mesh_of((8, 1, 1)), make_ids()
    table = pad_table(make_table(), 8)
    hlo = jax.jit(lambda t, i: sharded_lookup(t, i, mesh)).lower(table, ids).compile().as_text()
    assert "all-to-all" in hlo and "reduce-scatter" not in hlo


def test_bytes_model_prefers_all_to_all_at_realistic_sizes():
    for devices in (8, 64, 256):
        for heads in (16, 24):
            for head_dim in (32, 128, 256):
                args = (devices, heads, head_dim, 2)
                a2a = lookup_bytes_per_token("all_to_all", *args)
                psum = lookup_bytes_per_token("psum", *args)
                assert a2a["total"] < psum["total"] / 4 and a2a["backward"] < psum["backward"]
                assert a2a["total"] < 1.25 * (a2a["table_rows"] + heads * 4)  # ~ output once
    # hand count, 8 devices, 24 heads x 128 bf16: 1.25 * 24 * 7/8 slots of (4 + 256) bytes
    assert lookup_bytes_per_token("all_to_all", 8, 24, 128, 2)["total"] == 6825.0
    assert lookup_bytes_per_token("psum", 8, 24, 128, 2)["total"] == 7 * 24 * (4 + 512)
    for shape in MESHES:
        assert choose_method(mesh_of(shape), DEFAULT_ROW_AXES, ("data", "fsdp"), H, E, 4) == (
            "all_to_all"
        )
    assert choose_method(mesh_of((8, 1, 1)), ("tensor",), ("data", "fsdp"), H, E, 4) == "psum"
    assert ENGRAM_ROW_AXIS == "engram_rows"


def test_bad_inputs_raise_clear_errors():
    mesh, ids = mesh_of((8, 1, 1)), make_ids()
    table = pad_table(make_table(), 8)
    with pytest.raises(ValueError, match=r"1009 rows.*pad_table\(table, 8\).*1016"):
        sharded_lookup(make_table(), ids, mesh)
    with pytest.raises(ValueError, match="float32 must be an integer"):
        sharded_lookup(table, ids.astype(jnp.float32), mesh)
    with pytest.raises(ValueError, match=r"\(8, 21\) must be \[B, T, H\]"):
        sharded_lookup(table, ids.reshape(B, T * H), mesh)
    with pytest.raises(ValueError, match="B=4 is not a multiple of 8"):
        sharded_lookup(table, ids[:4], mesh)
    with pytest.raises(ValueError, match=r"ids span \[0, 1016\]"):
        sharded_lookup(table, ids.at[0, 0, 0].set(1016), mesh)
    with pytest.raises(ValueError, match="method='gather'"):
        sharded_lookup(table, ids, mesh, method="gather")
    with pytest.raises(ValueError, match="row_axes=\\('model',\\)"):
        sharded_lookup(table, ids, mesh, row_axes=("model",))
    with pytest.raises(ValueError, match=r"row_scale shape \(5,\)"):
        sharded_lookup(table, ids, mesh, row_scale=jnp.ones(5))
