"""Engram tables in host memory: the device state holds no table; a host-table run equals the
same run with device tables and the same sparse optimizer, step for step (Engram at layers 1
and 3), also when killed with SIGKILL mid-run and resumed; prefetched batches never use a
stale row (the patch is what makes them fresh: without it they differ)."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.decode import generate
from v41jax.engram.host_rows import HostRows
from v41jax.engram.training.host import HostTables
from v41jax.model import engram_rows_key
from v41jax.sharding import make_mesh
from v41jax.train import evaluate_run, load_run, train
from v41jax.train.state import make_state_fns

SETS = [
    "model.num_layers=4",
    "model.engram.layer_ids=1,3",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
    "model.engram.compressed_vocab_size=0",
    "optim.table_optimizer=sparse_adam",
    "train.steps=50",
    "train.eval_every=0",
    "train.log_every=1",
    "train.checkpoint_every=10",
    # one device, so both runs reduce the row gradients in the same order
    "mesh.data=1",
]


def tiny(placement, *extra):
    sets = SETS + [f"model.engram.table_placement={placement}", *extra]
    return config_lib.override(config_lib.get_config("tiny"), sets)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return np.array([json.loads(line)["loss"] for line in f if '"loss"' in line])


def test_the_device_state_holds_no_table():
    cfg = config_lib.override(tiny("host"), ["model.engram.compressed_vocab_size=400"])
    _, _, _, _, abstract = make_state_fns(cfg, make_mesh(cfg.mesh))
    import jax

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    assert paths and not [p for p in paths if "table" in p], paths
    with pytest.raises(ValueError, match="needs a row-sparse optim.table_optimizer"):
        tiny("host", "optim.table_optimizer=adam")


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["sparse_adam", "sinkhorn_sparse"])
def test_host_run_equals_device_run_and_survives_sigkill(tmp_path, kind):
    optimizer = f"optim.table_optimizer={kind}"
    device = str(tmp_path / "device")
    train(tiny("device", optimizer), device, progress=False)
    host = str(tmp_path / "host")
    sets = [*SETS, optimizer, "model.engram.table_placement=host"]
    argv = [
        sys.executable,
        "-m",
        "v41jax",
        "train",
        "--config",
        "tiny",
        "--workdir",
        host,
        "--no-progress",
    ] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = os.path.join(host, "checkpoints", "20")
    deadline = time.time() + 600
    while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()  # SIGKILL, somewhere after step 20's checkpoint
    proc.wait()
    assert os.path.isdir(ckpt)
    assert subprocess.run(argv, capture_output=True, timeout=600).returncode == 0
    a, b = _losses(device), _losses(host)
    assert len(a) == len(b) == 50
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert a[-1] < a[0] - 0.5  # and it trained
    # the run reads back with its tables still in host memory (eval, generate), or on device
    run, on_device = load_run(host), load_run(host, tables="device")
    ref = run.params["block_3"]["engram"]["table"]
    assert isinstance(ref, HostRows) and ref.shape[1] == 16
    table = on_device.params["block_3"]["engram"]["table"]
    np.testing.assert_array_equal(np.asarray(table), ref.source.table)
    prompts, lengths = np.array([[1, 5, 9, 2]], np.int32), np.array([4], np.int32)
    outs = [
        np.asarray(generate(r.params, r.cfg.model, prompts, lengths, max_new_tokens=6,
                            compression=r.compression.table))
        for r in (run, on_device)
    ]  # fmt: skip
    np.testing.assert_array_equal(*outs)
    ev_host, ev_device = evaluate_run(host, 2), evaluate_run(device, 2)
    assert abs(ev_host["val_loss"] - ev_device["val_loss"]) < 1e-4


def test_a_prefetched_batch_is_patched_after_updates():
    cfg = config_lib.override(tiny("host"), ["model.engram.compressed_vocab_size=400"])
    rng = np.random.default_rng(0)
    tables = {1: rng.normal(size=(4096, 16)).astype(np.float32)}
    cfg = config_lib.override(cfg, ["model.engram.layer_ids=1"])
    host = HostTables(cfg, tables)
    ids = rng.integers(0, 900, (2, 8, 4)).astype(np.int32)
    batch = host.gather({"engram_ids_1": ids})
    stale = batch[engram_rows_key(1)].copy()
    rows_u = batch["_host_rows"][1]
    n = int((rows_u < 4096).sum())
    grads = rng.normal(size=(rows_u.size, 16)).astype(np.float32)
    host.apply({1: rows_u}, {1: grads}, 0.1)  # an update lands after the batch was gathered
    fresh = host.gather({"engram_ids_1": ids})[engram_rows_key(1)]
    assert not np.array_equal(fresh[:n], stale[:n])  # without the patch the rows are stale
    patched, rows = host.patch(batch)
    np.testing.assert_array_equal(patched[engram_rows_key(1)], fresh)
    np.testing.assert_array_equal(rows[1], rows_u)
