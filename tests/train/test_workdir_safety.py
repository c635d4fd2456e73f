"""A refused command changes nothing in a workdir; `train --workdir W` resumes W from its own
config.json; a rerun may raise train.steps (the schedule of the trained steps is kept, so the
result equals a run that planned the longer length from the start) and nothing else that
would change the trained steps."""

import hashlib
import json
import os

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.sweep import RunSpec, run_sweep
from v41jax.train import load_run, train
from v41jax.train.resume import reconcile

FAST = ["train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), FAST + list(extra))


def snapshot(workdir) -> dict:
    """{relative path: sha256} of every file under `workdir` (None when it does not exist)."""
    if not os.path.exists(workdir):
        return None
    out = {}
    for root, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A finished 4-step tiny run (checkpoints at 2 and 4)."""
    workdir = str(tmp_path_factory.mktemp("run4") / "tiny")
    train(tiny("train.steps=4"), workdir, progress=False)
    return workdir


def _params(workdir):
    return [np.asarray(x) for x in jax.tree.leaves(load_run(workdir).params)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "small"],  # another config in the same workdir: the data-loss report
        [],  # no --config resumes from config.json, so an override is what differs
        ["--config", "tiny", "--set", "optim.lr=0.1"],
        ["--set", "train.steps=1"],  # below the latest checkpoint
        ["--set", "optim.schedule_steps=9"],  # would change the trained steps' schedule
    ],
)
def test_a_refused_train_changes_nothing(run4, argv, capsys):
    before = snapshot(run4)
    if argv == []:
        argv = ["--set", "model.d_model=32"]
    assert main(["train", "--workdir", run4, "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("different config" in err or "below the latest" in err), err
    assert snapshot(run4) == before
    assert load_run(run4).tokenizer.vocab_size == 512  # eval/generate still work


def test_a_refused_new_run_creates_no_workdir(tmp_path, capsys):
    for extra, named in (
        (["train.eval_batches=500"], "train.eval_batches=500"),
        (["data.global_batch_size=3", "mesh.data=2"], "global_batch_size=3"),
    ):
        workdir = str(tmp_path / named)
        with pytest.raises(ValueError, match=named):
            train(tiny(*extra), workdir, progress=False)
        assert not os.path.exists(workdir)
    assert main(["train", "--config", "tiny", "--workdir", str(tmp_path / "x"),
                 "--set", "train.init_from=" + str(tmp_path / "nothing")]) == 2  # fmt: skip
    assert "holds no run" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_resume_from_its_own_config_and_raise_steps(run4, tmp_path, capsys):
    """`train --workdir W --set train.steps=6` continues W from its config.json (log_every and
    every original --set kept); the result equals a fresh run planned as 6 steps with the
    4-step schedule, and a plain `train --workdir W` afterwards has nothing left to do."""
    import shutil

    workdir = str(tmp_path / "extended")
    shutil.copytree(run4, workdir)
    first = [r for r in _metrics(workdir) if "loss" in r]
    assert main(["train", "--workdir", workdir, "--no-progress", "--set", "train.steps=6"]) == 0
    out = capsys.readouterr().out
    assert "train.steps: 4 -> 6" in out and "optim.schedule_steps kept at 4" in out
    saved = config_lib.load_json(os.path.join(workdir, "config.json"))
    assert (saved.train.steps, saved.optim.schedule_steps, saved.train.log_every) == (6, 4, 1)
    with open(os.path.join(workdir, "config_changes.jsonl")) as f:
        record = json.loads(f.readline())
    assert record["step"] == 4 and "train.steps: 4 -> 6" in record["changes"]
    rows = [r for r in _metrics(workdir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[:4] == first

    planned = str(tmp_path / "planned")
    train(tiny("train.steps=6", "optim.schedule_steps=4"), planned, progress=False)
    for a, b in zip(_params(workdir), _params(planned), strict=True):
        np.testing.assert_array_equal(a, b)
    # the run's own config.json also works as --config, and nothing is left to train
    config_path = os.path.join(workdir, "config.json")
    assert main(["train", "--config", config_path, "--workdir", workdir, "--no-progress"]) == 0
    assert main(["train", "--workdir", workdir, "--no-progress"]) == 0
    assert [r["step"] for r in _metrics(workdir) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_reconcile_names_what_a_rerun_may_change():
    saved = tiny("train.steps=4")
    ok, changes = reconcile(saved, tiny("train.steps=4", "train.log_every=2"), 2, "W")
    assert changes == ["train.log_every: 1 -> 2"] and ok.optim.schedule_steps == 0
    ok, changes = reconcile(saved, tiny("train.steps=8", "model.remat_policy=full"), 4, "W")
    assert ok.optim.schedule_steps == 4 and "model.remat_policy: 'none' -> 'full'" in changes
    # nothing trained yet: the new length is the schedule's
    ok, _ = reconcile(saved, tiny("train.steps=8"), None, "W")
    assert ok.optim.schedule_steps == 0
    with pytest.raises(ValueError, match=r"data.seq_len: 64 -> 32.*a rerun may change only"):
        reconcile(saved, tiny("train.steps=4", "data.seq_len=32"), 2, "W")
    # the same tokens from a token dir (its manifest is checked against data.* on load)
    ok, changes = reconcile(saved, tiny("train.steps=4", "data.token_dir=/t"), 2, "W")
    assert changes == ["data.token_dir: '' -> '/t'"]


def test_a_refused_sweep_changes_nothing(run4, tmp_path):
    """A sweep whose run directory holds another config refuses before writing anything."""
    import shutil

    runs = str(tmp_path / "runs")
    spec = RunSpec("s", "a", 0, tiny("train.steps=4", "optim.lr=0.1"))
    shutil.copytree(run4, spec.workdir(runs))
    before = snapshot(runs)
    with pytest.raises(ValueError, match="different config"):
        run_sweep([spec], runs, progress=False)
    assert snapshot(runs) == before
