"""Row-sparse Engram table training in the train step: the gradient of the gathered rows is
the dense table gradient's non-zero rows (fp32 and the FP8 master path); the rows no batch
read are bit-identical after training; a sparse run resumes exactly; on 8 devices with
row-sharded tables it matches one device."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from v41jax import config as config_lib
from v41jax.data import prepare_data
from v41jax.engram.training.sparse import (
    gather_rows,
    merge_tables,
    row_shard_plans,
    split_tables,
    with_rows,
)
from v41jax.sharding import make_mesh
from v41jax.train import load_run, train
from v41jax.train.batches import add_engram_ids
from v41jax.train.loop import resolve_data_dependent
from v41jax.train.state import make_state_fns
from v41jax.train.step import _forward_loss

ENGRAM = [
    "model.engram.layer_ids=0,1",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
]
RUN = ["train.eval_every=0", "train.log_every=1", "train.checkpoint_every=2"]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), ENGRAM + RUN + list(extra))


@pytest.mark.parametrize("table_dtype", ["float32", "float8_e4m3fn"])
def test_row_gradients_are_the_dense_table_gradient(table_dtype):
    cfg = tiny(f"model.engram.table_dtype={table_dtype}")
    data = prepare_data(cfg.data, show_progress=False)
    cfg = resolve_data_dependent(cfg, data)
    model, _, init_fn, _, _ = make_state_fns(cfg, make_mesh(cfg.mesh))
    params = init_fn(0).params
    from v41jax.data import BatchIterator

    it = BatchIterator(data.train_tokens, data.train_segments, 64, 8, 0)
    batch = {k: jnp.asarray(v) for k, v in add_engram_ids(it.batch_at(0), data.compression,
                                                           cfg.model).items()}  # fmt: skip
    (loss_d, _), g_dense = jax.value_and_grad(
        lambda p: _forward_loss(model, p, batch, 0.0), has_aux=True
    )(params)
    rest, tables = split_tables(params)
    gathered = gather_rows(cfg, tables, batch)
    rows_e = {layer: e for layer, (_, _, e) in gathered.items()}
    (loss_s, _), (g_rest, g_rows) = jax.value_and_grad(
        lambda r, e: _forward_loss(model, merge_tables(r, tables), with_rows(batch, gathered, e),
                                   0.0),
        argnums=(0, 1), has_aux=True,
    )(rest, rows_e)  # fmt: skip
    np.testing.assert_allclose(loss_s, loss_d, rtol=1e-6)
    flat_dense = traverse_util.flatten_dict(g_dense)
    for path, g in traverse_util.flatten_dict(g_rest).items():
        np.testing.assert_allclose(g, flat_dense[path], rtol=2e-5, atol=1e-7)
    for layer, (rows, _, _) in gathered.items():
        path = (f"block_{layer}", "engram", "table")
        dense = np.asarray(flat_dense[path])
        scattered = jnp.zeros_like(dense).at[rows].add(g_rows[layer], mode="drop")
        np.testing.assert_allclose(scattered, dense, rtol=2e-5, atol=1e-8)
        assert 0 < np.count_nonzero(np.abs(dense).sum(1)) < dense.shape[0] // 2


def _tables(workdir):
    flat = traverse_util.flatten_dict(load_run(workdir).params)
    return {p: np.asarray(v) for p, v in flat.items() if p[-2:] == ("engram", "table")}


@pytest.mark.parametrize(
    "kind",
    ["sparse_adam", "sinkhorn_sparse", pytest.param("rowwise_adagrad", marks=pytest.mark.slow)],
)
def test_unread_rows_unchanged_and_resume_exact(kind, tmp_path):
    big = "model.engram.engram_vocab_size=20000,20000"  # most rows stay unread in 4 steps
    cfg = tiny("train.steps=4", f"optim.table_optimizer={kind}", big)
    first = str(tmp_path / "straight")
    train(cfg, first, progress=False)
    # resume: kill after step 2's checkpoint, rerun the same command
    second = str(tmp_path / "resumed")
    train(cfg, second, progress=False)
    import shutil

    shutil.rmtree(os.path.join(second, "checkpoints", "4"))
    train(cfg, second, progress=False)
    resolved = load_run(first).cfg
    params0 = make_state_fns(resolved, make_mesh(resolved.mesh))[2](resolved.train.seed).params
    flat0 = traverse_util.flatten_dict(params0)
    a, b = _tables(first), _tables(second)
    start = {p: np.asarray(flat0[p]) for p in a}
    for path in a:
        np.testing.assert_array_equal(a[path], b[path])
        changed = np.any(a[path] != start[path], axis=1)
        assert 0 < changed.sum() < 0.25 * len(changed)  # only the rows some batch read
    with open(os.path.join(first, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert losses[-1] < losses[0]


@pytest.mark.slow  # two trainings; the compiled 8-device step's collectives are checked fast
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
def test_row_sharded_sparse_training_matches_one_device(tmp_path):
    losses = {}
    for name, mesh in (("one", ["mesh.data=1"]), ("eight", ["mesh.data=2", "mesh.fsdp=4"])):
        cfg = tiny("train.steps=3", "optim.table_optimizer=sparse_adam", *mesh)
        workdir = str(tmp_path / name)
        train(cfg, workdir, progress=False)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            losses[name] = [json.loads(line)["loss"] for line in f if '"loss"' in line]
        if name == "eight":
            _, _, _, shardings, _ = make_state_fns(cfg, make_mesh(cfg.mesh))
            tables = shardings.opt_state["tables"]
            assert all(s["m"].spec[0] for s in tables.values())  # state row-sharded
    np.testing.assert_allclose(losses["eight"], losses["one"], rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
def test_row_sharded_step_moves_no_table_sized_array():
    """Compiled on 8 devices with the tables row-sharded, no collective of the sparse step
    carries an array with the table's row count, nor one with the batch's id count (the
    global [N, C] row gradient): rows and their gradients travel by all-to-all in [S, C_x]
    blocks, and each owner updates its rows (and their optimizer state) in place."""
    import re

    from v41jax import sharding
    from v41jax.bench.table_bench import config_for, synthetic_batch
    from v41jax.train.step import device_batch, make_train_step

    cfg = config_lib.override(config_for(1e6, "sparse_adam"), ["mesh.data=2", "mesh.fsdp=4"])
    mesh = make_mesh(cfg.mesh)
    model, opt, _, shardings, abstract = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, opt, shardings)
    batch = device_batch(mesh, synthetic_batch(cfg, 0))
    with jax.set_mesh(mesh), sharding.axis_rules():
        hlo = step.jitted.lower(abstract, batch).compile().as_text()
    rows = abstract.params["block_1"]["engram"]["table"].shape[0]
    collectives = [
        line
        for line in hlo.splitlines()
        if re.search(r" (all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)\(",
                     line)
    ]  # fmt: skip
    assert collectives  # the dense params' gradients are reduced
    shard, n_ids = rows // 8, batch["engram_ids_1"].size
    sizes = rf"\[({rows}|{shard}|{n_ids})[,\]]"
    assert not [c for c in collectives if re.search(sizes, c)], collectives
    assert [c for c in collectives if " all-to-all(" in c and "s32[" in c]  # row requests


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
@pytest.mark.parametrize(
    "table_dtype, kind",
    [
        ("float32", "sparse_adam"),
        ("float32", "sinkhorn_sparse"),
        pytest.param("float8_e4m3fn", "sparse_adam", marks=pytest.mark.slow),
    ],
)
def test_an_all_to_all_sparse_step_equals_the_one_device_step(table_dtype, kind):
    """Two steps of the sparse step on 8 devices (rows and row gradients by all-to-all,
    owners updating their shards) give the one-device step's loss, tables and table
    optimizer state (the FP8 master's fake-quantised rows included)."""
    from v41jax import sharding
    from v41jax.bench.table_bench import config_for, synthetic_batch
    from v41jax.train.step import device_batch, make_train_step

    extra = [f"model.engram.table_dtype={table_dtype}"]
    results = {}
    for name, mesh_set in (("one", ["mesh.data=1"]), ("eight", ["mesh.data=2", "mesh.fsdp=4"])):
        cfg = config_lib.override(config_for(1e5, kind), mesh_set + extra)
        mesh = make_mesh(cfg.mesh)
        model, opt, init_fn, shardings, _ = make_state_fns(cfg, mesh)
        step = make_train_step(cfg, mesh, model, opt, shardings)
        state = init_fn(0)
        with jax.set_mesh(mesh), sharding.axis_rules():
            plans = row_shard_plans(cfg, split_tables(state.params)[1], cfg.data.global_batch_size)
        assert bool(plans) == (name == "eight")  # the all-to-all path is the one under test
        losses = []
        for s in range(2):
            state, metrics = step(state, device_batch(mesh, synthetic_batch(cfg, s)))
            losses.append(float(metrics["loss"]))
        results[name] = (losses, jax.device_get(state.params), jax.device_get(state.opt_state))
    (l1, p1, o1), (l8, p8, o8) = results["one"], results["eight"]
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    _, t1 = split_tables(p1)
    _, t8 = split_tables(p8)
    for path in t1:
        np.testing.assert_allclose(t8[path], t1[path], rtol=1e-5, atol=1e-6)
    for key, st in o1["tables"].items():
        for name, v in st.items():
            np.testing.assert_allclose(o8["tables"][key][name], v, rtol=1e-5, atol=1e-7)
