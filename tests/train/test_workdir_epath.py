"""Workdirs on any `etils.epath` path: the loop, its resume and `load_run` go through epath.

Offline there is no bucket, so two stand-ins:
- a workdir the code must treat as remote (`workdir.is_local` says no) that epath keeps on
  this disk: a run, its resume and `load_run` work, give the params of a plain local run,
  and no v41jax code calls `open` / `os` on a path under it (a guard records any such call);
- gs:// paths on an in-memory fsspec filesystem that, like GCS, cannot append: the run's
  small files (metrics, config, changes, tokenizer) and the checkpoint listing.
Features that need a local directory are refused naming the workdir.
"""

import builtins
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from v41jax import config as config_lib
from v41jax.data.tokenizer import train_tokenizer
from v41jax.train import load_run, train
from v41jax.train import workdir as workdir_lib
from v41jax.train.metrics import MetricsWriter, read_metrics
from v41jax.train.resume import latest_checkpoint_step, saved_config
from v41jax.train.run_files import load_tokenizer

FAST = ["train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]
GUARDED = {  # module -> names whose first argument is a path
    builtins: ["open"],
    os: ["listdir", "makedirs", "mkdir", "replace", "rename", "remove", "unlink", "scandir"],
    os.path: ["exists", "isdir", "isfile", "getsize"],
    np: ["load", "save", "savez"],
    shutil: ["rmtree", "copytree", "move"],
}


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), FAST + list(extra))


@pytest.fixture
def guard(monkeypatch):
    """Make paths under `guard.root` remote to v41jax and record any v41jax call of a plain
    file function on them (epath's and orbax's own calls are theirs, not the loop's)."""

    class Guard:
        root, calls = None, []

        def under(self, path) -> bool:
            try:
                text = os.fspath(path)
            except TypeError:
                return False
            text = text.decode() if isinstance(text, bytes) else text
            text = os.path.abspath(text)
            return self.root is not None and (text + os.sep).startswith(self.root + os.sep)

    g = Guard()
    real_is_local = workdir_lib.is_local
    monkeypatch.setattr(workdir_lib, "is_local", lambda p: not g.under(p) and real_is_local(p))

    def wrap(module, name, real):
        def guarded(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("v41jax") and args and g.under(args[0]):
                g.calls.append(f"{caller}: {module.__name__}.{name}({args[0]})")
            return real(*args, **kwargs)

        return guarded

    for module, names in GUARDED.items():
        for name in names:
            monkeypatch.setattr(module, name, wrap(module, name, getattr(module, name)))
    return g


def _params(run):
    return [np.asarray(x) for x in jax.tree.leaves(run.params)]


def test_run_resume_and_load_run_touch_the_workdir_only_through_epath(guard, tmp_path):
    root = tmp_path / "bucket" / "run"
    guard.root = str(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    config_lib.save_json(tiny(), str(tmp_path / "bucket.json"))  # outside: not recorded
    config_lib.save_json(tiny(), str(tmp_path / "bucket" / "probe.json"))  # the guard works
    assert guard.calls == [f"v41jax.config.text: builtins.open({root.parent}/probe.json)"]
    guard.calls.clear()

    train(tiny("train.steps=4", "train.tensorboard=false"), epath.Path(root), progress=False)
    with (root / "metrics.jsonl").open("a") as f:  # a line a killed run wrote after step 4
        f.write(json.dumps({"step": 5, "loss": 9.0}) + "\n")
    # the resume, given as text: train.steps raised, the schedule kept
    train(tiny("train.steps=6", "train.tensorboard=false"), str(root), progress=False)
    run = load_run(epath.Path(root))
    assert guard.calls == []
    assert run.step == 6 and latest_checkpoint_step(root) == 6
    rows = [r for r in read_metrics(root / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[4]["loss"] != 9.0
    assert json.loads((root / "metrics.jsonl.after_4").read_text())["loss"] == 9.0
    changes = json.loads((root / "config_changes.jsonl").read_text())
    assert changes["step"] == 4 and "train.steps: 4 -> 6" in changes["changes"]
    assert json.loads((root / "eval.json").read_text())["step"] == 6
    assert saved_config(root).train.steps == 6

    guard.root = None  # the same run planned as 6 steps in a plain local directory
    local = str(tmp_path / "local")
    train(tiny("train.steps=6", "optim.schedule_steps=4", "train.tensorboard=false"), local,
          progress=False)  # fmt: skip
    for a, b in zip(_params(run), _params(load_run(local)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (root / "config.json").read_text() == open(os.path.join(local, "config.json")).read()


class FakeGCS(MemoryFileSystem):
    """gs://bucket/... in memory; like GCS, no append."""

    protocol = ("gs", "gcs")
    store, pseudo_dirs = {}, [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        path = path[len("gs://") :] if path.startswith("gs://") else path.lstrip("/")
        return "/" + path.rstrip("/")

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise NotImplementedError(f"{path}: an object store cannot append")
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def gcs(monkeypatch):
    fs = FakeGCS()
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: fs)
    return epath.Path("gs://bucket/run")


def test_small_files_on_a_gs_workdir_without_append(gcs):
    assert not workdir_lib.is_local(gcs) and os.fspath(gcs) == "gs://bucket/run"
    gcs.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter("gs://bucket/run/metrics.jsonl")
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": float(step)})
    assert [r["step"] for r in read_metrics(gcs / "metrics.jsonl")] == [1, 2, 3]
    MetricsWriter(gcs / "metrics.jsonl", resume_step=1).write({"step": 2, "loss": 2.5})
    assert [r["loss"] for r in read_metrics(gcs / "metrics.jsonl")] == [1.0, 2.5]
    assert len((gcs / "metrics.jsonl.after_1").read_text().splitlines()) == 2
    for i in range(2):
        workdir_lib.append_line(gcs / "config_changes.jsonl", json.dumps({"i": i}))
    assert (gcs / "config_changes.jsonl").read_text() == '{"i": 0}\n{"i": 1}\n'

    cfg = tiny()
    workdir_lib.save_config(cfg, gcs / "config.json")
    assert saved_config("gs://bucket/run") == cfg
    tokenizer = train_tokenizer(["a few words of text to learn from"] * 20, vocab_size=260)
    workdir_lib.write_via_local(gcs / "tokenizer.json", tokenizer.save)
    assert load_tokenizer(gcs).encode("a few words") == tokenizer.encode("a few words")
    # a Hugging Face tokenizer's eos lives in the tokenizer_config.json beside it
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from v41jax.data import Tokenizer

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    hf = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = epath.Path("gs://bucket/hf")
    other.mkdir(parents=True, exist_ok=True)
    workdir_lib.write_via_local(other / "tokenizer.json", Tokenizer(hf, "</s>").save)
    assert json.loads((other / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}
    loaded = load_tokenizer(other)
    assert loaded.eos_token == "</s>" and loaded.eos_id == 2

    # orbax's notion of a complete step on GCS: its commit marker, not a rename
    assert latest_checkpoint_step(gcs) is None
    for step, done in ((4, True), (8, True), (12, False)):
        (gcs / "checkpoints" / str(step)).mkdir(parents=True, exist_ok=True)
        (gcs / "checkpoints" / str(step) / ("commit_success.txt" if done else "x")).write_text("")
    assert latest_checkpoint_step("gs://bucket/run") == 8


def test_what_needs_a_local_directory_is_refused_naming_the_workdir(gcs):
    engram = [
        "model.engram.layer_ids=1",
        "model.engram.engram_vocab_size=1000,1000",
        "model.engram.table_placement=host",
        "optim.table_optimizer=sparse_adam",
    ]
    cases = [
        (tiny(*engram, "model.engram.table_path=tables"), "model.engram.table_path='tables'"),
        (tiny("train.profile_steps=2,3", "train.tensorboard=false"), "train.profile_steps"),
    ]
    from tensorboardX import record_writer

    if not record_writer.GCS_ENABLED:  # here: google-cloud-storage is not installed
        cases.append((tiny(), "tensorboardX writes gs:// only with google-cloud-storage"))
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            train(cfg, "gs://bucket/run", progress=False)
        assert "gs://bucket/run" in str(err.value)
    assert not gcs.exists()  # refused before anything was read or written
    with pytest.raises(ValueError, match="'memory://x'.*memory://"):
        train(tiny(), "memory://x", progress=False)
    with pytest.raises(ValueError, match="'memory://x'"):
        load_run("memory://x")


DRAFTER = [  # a small drafter, trained for 2 steps
    "drafter.num_layers=1",
    "drafter.block_size=3",
    "drafter.markov_rank=4",
    "drafter.window=16",
    "train.batch_size=8",
    "train.anchors_per_seq=2",
    "train.steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
]


def test_a_drafter_run_touches_its_workdir_only_through_epath(guard, tmp_path):
    """train-drafter (`v41jax.train.run.Run`, as train) on a workdir the code must treat as
    remote: trained, rerun (finished: its eval.json read back) and loaded for decoding with
    no plain file call on it."""
    from v41jax.dspark.train.config import DrafterRunConfig
    from v41jax.dspark.train.load import load_drafter
    from v41jax.dspark.train.loop import train_drafter

    target = str(tmp_path / "target")
    target_cfg = tiny("train.steps=2", "model.max_seq_len=64", "train.tensorboard=false")
    train(target_cfg, target, progress=False)
    guard.root = str(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    root = epath.Path(tmp_path / "bucket" / "drafter")
    cfg = config_lib.override(DrafterRunConfig(), DRAFTER)
    result = train_drafter(cfg, target, root, progress=False)
    assert train_drafter(cfg, target, str(root), progress=False) == result
    _, params, record = load_drafter(root)
    assert guard.calls == []
    assert result["step"] == 2 and json.loads((root / "eval.json").read_text()) == result
    assert record["step"] == 2 and record["target_workdir"] == "../../target"
    assert [r["step"] for r in read_metrics(root / "metrics.jsonl")] == [1, 2, 2]
    assert not (root / "drafter.json.tmp").exists() and jax.tree.leaves(params)


def test_a_drafter_record_on_a_gs_workdir(gcs):
    """drafter.json on gs://: written whole (no append, no rename), read back and checked;
    a target in the same bucket is recorded relative to it, one elsewhere as its URL."""
    from v41jax.dspark.train.config import DrafterRunConfig
    from v41jax.dspark.train.record import (
        check_record,
        recorded_target,
        relative_to_workdir,
        write_record,
    )
    from v41jax.train.run import Run

    run = Run("gs://bucket/run", keep_checkpoints=1)
    target = relative_to_workdir("gs://bucket/models/target", run.path)
    assert target == "../models/target"
    config = config_lib.to_dict(DrafterRunConfig())
    record = {"config": config, "target_workdir": target, "target_step": 6}
    record |= {"target_identity": "abc", "init_from": None}
    assert not check_record(run, record)  # a new run
    write_record(run, record)
    text = (gcs / "drafter.json").read_text()
    assert text == json.dumps(record, indent=2, sort_keys=True)
    assert check_record(run, record)  # resumable
    assert recorded_target(run.path, record) == "gs://bucket/models/target"
    with pytest.raises(ValueError, match="train.lr"):
        changed = config_lib.override(DrafterRunConfig(), ["train.lr=0.1"])
        check_record(run, {**record, "config": config_lib.to_dict(changed)})
    assert relative_to_workdir("/data/target", run.path) == "/data/target"
    run.write_eval({"step": 6})
    assert run.read_eval() == {"step": 6}
