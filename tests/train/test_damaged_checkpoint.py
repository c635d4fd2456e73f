"""A damaged checkpoint (a file of checkpoints/<step> cut short) is named, never used and
never deleted: `eval` evaluates the newest intact step and says which; `train` resumes from it
exactly, with the damaged step set aside under checkpoints/damaged/; a run with no intact
checkpoint is refused in one line naming them; a config / tree mismatch is not damage."""

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.sharding import make_mesh
from v41jax.train import load_run, train
from v41jax.train.checkpoint import Checkpointer, DamagedCheckpointError
from v41jax.train.state import make_state_fns

# orbax leaves the reads of a failed restore to be collected: their errors are reported as
# unraisable, which says nothing about the behaviour tested here
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

FAST = ["train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), FAST + list(extra))


def snapshot(workdir) -> dict:
    """{relative path: sha256} of every file under `workdir`."""
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


def _largest_array_file(step_dir: str) -> str:
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs]  # fmt: skip
    return max(files, key=os.path.getsize)


def _damaged_copy(run4, tmp_path, steps=(4,), name="run"):
    """A copy of `run4` with the largest array file of each step in `steps` cut in half."""
    workdir = str(tmp_path / name)
    shutil.copytree(run4, workdir)
    for step in steps:
        path = _largest_array_file(os.path.join(workdir, "checkpoints", str(step)))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return workdir


def _params(workdir, step=None):
    return [np.asarray(x) for x in jax.tree.leaves(load_run(workdir, step=step).params)]


def test_eval_uses_the_newest_intact_step_and_changes_nothing(run4, tmp_path, capsys):
    workdir = _damaged_copy(run4, tmp_path)
    before = snapshot(workdir)
    assert main(["eval", "--workdir", workdir]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 2
    assert "checkpoint 4 in" in err and "is damaged" in err and "using step 2" in err, err
    assert "left in place" in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(workdir) == before  # read-only: nothing renamed
    # the same params as step 2 of the intact run
    for a, b in zip(_params(workdir), _params(run4, step=2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_asking_for_the_damaged_step_names_it(run4, tmp_path):
    workdir = _damaged_copy(run4, tmp_path)
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 4: .* is damaged"):
        load_run(workdir, step=4)


def test_train_resumes_from_the_intact_step_exactly_and_keeps_the_damaged_one(
    run4, tmp_path, capsys
):
    workdir = _damaged_copy(run4, tmp_path)
    damaged_files = sorted(
        os.path.relpath(os.path.join(r, f), os.path.join(workdir, "checkpoints", "4"))
        for r, _, fs in os.walk(os.path.join(workdir, "checkpoints", "4"))
        for f in fs
    )
    assert main(["train", "--workdir", workdir, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint 4 in" in err and "set aside as" in err and "using step 2" in err, err
    assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("/2")
    # the damaged step is kept, renamed out of orbax's sight; step 4 was trained again
    aside = os.listdir(os.path.join(workdir, "checkpoints", "damaged"))
    assert len(aside) == 1 and aside[0].startswith("4-")
    kept = os.path.join(workdir, "checkpoints", "damaged", aside[0])
    assert (
        sorted(os.path.relpath(os.path.join(r, f), kept) for r, _, fs in os.walk(kept) for f in fs)
        == damaged_files
    )
    assert load_run(workdir).step == 4
    for a, b in zip(_params(workdir), _params(run4), strict=True):  # exact resume
        np.testing.assert_array_equal(a, b)
    with open(os.path.join(workdir, "eval.json")) as f:
        assert json.load(f)["step"] == 4
    # metrics.jsonl: one train line per step, the first lines of steps 3-4 kept aside
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert "steps 3-4 are moved to metrics.jsonl.after_2" in err, err
    with open(os.path.join(workdir, "metrics.jsonl.after_2")) as f:
        assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [3, 4]


def test_a_resume_with_changes_records_the_step_it_resumes_from(run4, tmp_path, capsys):
    """Checkpoint 4 damaged, `--set train.steps=6`: config_changes.jsonl and the message name
    step 2, the one resumed from, not the damaged 4."""
    workdir = _damaged_copy(run4, tmp_path)
    argv = ["train", "--workdir", workdir, "--no-progress", "--set", "train.steps=6"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "checkpoint 4 in" in err and "using step 2" in err, err
    assert f"resuming {workdir} at step 2 with changes: train.steps: 4 -> 6" in out, out
    with open(os.path.join(workdir, "config_changes.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [2], records
    assert load_run(workdir).step == 6


def test_no_intact_checkpoint_is_refused_in_one_line(run4, tmp_path, capsys):
    workdir = _damaged_copy(run4, tmp_path, steps=(2, 4))
    before = snapshot(workdir)
    train_ = ["train", "--workdir", workdir, "--no-progress"]
    for argv in (["eval", "--workdir", workdir], train_, [*train_, "--set", "train.steps=6"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "no intact checkpoint" in lines[0], err
        assert "step 4:" in lines[0] and "step 2:" in lines[0] and "from a copy" in lines[0]
        assert snapshot(workdir) == before  # train did not start over from step 0


def test_a_mismatch_is_not_damage(run4, tmp_path):
    """A checkpoint restored into another model fails with orbax's own message and is
    neither called damaged nor set aside."""
    workdir = str(tmp_path / "run")
    shutil.copytree(run4, workdir)
    cfg = tiny("train.steps=4", "model.d_model=32")
    _, _, _, _, abstract = make_state_fns(cfg, make_mesh(cfg.mesh))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), 3)
    with pytest.raises(ValueError, match="not compatible with the stored shape") as e:
        ckpt.restore_newest_intact(lambda s: ckpt.restore(s, abstract), set_aside=True)
    assert not isinstance(e.value, DamagedCheckpointError)
    assert ckpt.damage(4) is None and ckpt.all_steps() == [2, 4]
    ckpt.close()
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "damaged"))


@pytest.mark.parametrize("cut", ["data/metadata", "state/_METADATA"])
def test_damage_names_the_file_when_it_can(run4, tmp_path, cut):
    workdir = str(tmp_path / "run")
    shutil.copytree(run4, workdir)
    path = os.path.join(workdir, "checkpoints", "4", cut)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), 3)
    what = ckpt.damage(4)
    assert what is not None and path in what and "not valid JSON" in what, what
    assert ckpt.damage(2) is None
    ckpt.close()


HOST = [
    "model.num_layers=4",
    "model.engram.layer_ids=1,3",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
    "model.engram.table_placement=host",
    "optim.table_optimizer=sparse_adam",
    "mesh.data=1",
    "train.steps=4",
]


def test_host_tables_come_from_the_same_intact_step(tmp_path, capsys):
    """Step 4's host tables damaged (its state intact): the run resumes from step 2, state
    and tables alike, and ends where the uninterrupted run did."""
    whole = str(tmp_path / "whole")
    train(tiny(*HOST), whole, progress=False)
    workdir = str(tmp_path / "run")
    shutil.copytree(whole, workdir)
    tables = os.path.join(workdir, "checkpoints", "4", "host_tables")
    path = max((os.path.join(r, f) for r, _, fs in os.walk(tables) for f in fs),
               key=os.path.getsize)  # fmt: skip
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    capsys.readouterr()
    train(tiny(*HOST), workdir, progress=False)
    err = capsys.readouterr().err
    assert "checkpoint 4 in" in err and "host_tables" in err and "using step 2" in err, err
    done = [load_run(w, tables="device") for w in (whole, workdir)]
    assert done[0].step == done[1].step == 4
    for a, b in zip(*(jax.tree.leaves(r.params) for r in done), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
