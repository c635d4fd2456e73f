"""Engram tables in memory-mapped files during training (`model.engram.table_path`): the
file-backed host tables compute exactly what in-memory host tables compute; a checkpoint is
a snapshot log, never a copy; a run killed with SIGKILL resumes to the same losses as an
uninterrupted one; the trained files decode; foreign directories and bad configs are refused.
"""

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
from v41jax.engram.table_file import TableFile
from v41jax.engram.training.file_arrays import _at_snapshot, open_table_files, table_dir
from v41jax.engram.training.host import HostTables
from v41jax.model import engram_ids_key
from v41jax.train import load_run, train

SETS = [
    "model.num_layers=3",
    "model.engram.layer_ids=1",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
    "model.engram.table_placement=host",
    "model.engram.table_path=tables",
    "optim.table_optimizer=sparse_adam",
    "train.steps=24",
    "train.eval_every=0",
    "train.log_every=1",
    "train.checkpoint_every=8",
    "mesh.data=1",
]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), SETS + list(extra))


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return np.array([json.loads(line)["loss"] for line in f if '"loss"' in line])


@pytest.mark.parametrize("kind", ["sparse_adam", "rowwise_adagrad", "sinkhorn_sparse"])
def test_file_tables_equal_in_memory_tables_and_restore_a_snapshot(tmp_path, kind):
    cfg = tiny(f"optim.table_optimizer={kind}", "model.engram.compressed_vocab_size=400")
    tables, states = open_table_files(cfg, str(tmp_path), 0)
    init = {k: t[np.arange(t.shape[0])] for k, t in tables.items()}
    files, memory = HostTables(cfg, tables, states), HostTables(cfg, init)
    assert files.files and not memory.files
    rng = np.random.default_rng(0)
    saved = None
    for step in range(1, 7):
        ids = rng.zipf(1.3, (2, 8, 4)).clip(max=899).astype(np.int32)
        batches = [h.gather({engram_ids_key(1): ids}) for h in (files, memory)]
        for h, b in zip((files, memory), batches, strict=True):
            _, rows = h.patch(b)
            grads = np.random.default_rng(step).normal(size=(rows[1].size, 16))
            h.apply(rows, {1: grads.astype(np.float32)}, 0.05, step=step)
        if step == 3:
            assert files.checkpoint(3) is None  # a snapshot log, nothing for orbax
            saved = {k: v[np.arange(v.shape[0])] for k, v in files.states[1].items()}
            saved["table"] = files.tables[1][np.arange(files.tables[1].shape[0])]
    r = memory.tables[1].shape[0]
    np.testing.assert_array_equal(files.tables[1][np.arange(r)], memory.tables[1])
    for name, a in memory.states[1].items():
        np.testing.assert_array_equal(files.states[1][name][np.arange(r)], a)
    # rows written after snapshot 3 are undone when the files are rebuilt as of step 3
    root = table_dir(cfg, str(tmp_path))
    back = _at_snapshot(os.path.join(root, "layer_1"), 3)
    np.testing.assert_array_equal(back.gather(np.arange(r)), saved["table"])
    assert not np.array_equal(saved["table"], memory.tables[1])


@pytest.mark.e2e
def test_a_killed_file_table_run_resumes_exactly_and_decodes(tmp_path):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    train(tiny(), whole, progress=False)
    argv = [sys.executable, "-m", "v41jax", "train", "--config", "tiny", "--workdir", killed,
            "--no-progress"] + [x for s in SETS for x in ("--set", s)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = os.path.join(killed, "checkpoints", "8")
    deadline = time.time() + 600
    while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()  # SIGKILL after step 8's checkpoint, rows of later steps already written
    proc.wait()
    assert os.path.isdir(ckpt)
    assert subprocess.run(argv, capture_output=True, timeout=600).returncode == 0
    a, b = _losses(whole), _losses(killed)
    assert len(a) == len(b) == 24
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    table = TableFile(os.path.join(whole, "tables", "layer_1"), mode="r")
    assert table.snapshots() == [8, 16, 24]
    assert os.listdir(os.path.join(whole, "checkpoints", "24")).count("host_tables") == 0
    runs = [load_run(w) for w in (whole, killed)]
    assert all(isinstance(r.params["block_1"]["engram"]["table"], HostRows) for r in runs)
    prompts, lengths = np.array([[1, 5, 9, 2]], np.int32), np.array([4], np.int32)
    outs = [
        np.asarray(generate(r.params, r.cfg.model, prompts, lengths, max_new_tokens=5,
                            compression=r.compression.table))
        for r in runs
    ]  # fmt: skip
    np.testing.assert_array_equal(*outs)


def test_foreign_table_dirs_and_bad_configs_are_refused(tmp_path):
    cfg = tiny("model.engram.compressed_vocab_size=400",
               f"model.engram.table_path={tmp_path / 'shared'}")  # fmt: skip
    open_table_files(cfg, str(tmp_path / "a"), 0)
    with pytest.raises(FileExistsError, match="does not belong to"):
        open_table_files(cfg, str(tmp_path / "b"), 0)
    with pytest.raises(ValueError, match="table_path='t' needs table_placement='host'"):
        tiny("model.engram.table_placement=device", "model.engram.table_path=t",
             "optim.table_optimizer=sparse_adam")  # fmt: skip
