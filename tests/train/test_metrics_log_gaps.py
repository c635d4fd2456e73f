"""metrics.jsonl after damage: on a resume the run says which steps its log lacks and why
(a line cut short by a kill mid-write, lines lost after it), records it in the log, keeps the
cut and superseded lines in a side file, and the log stays one parseable line per train
step where steps are trained again."""

import json
import os
import shutil

import pytest

from v41jax import config as config_lib
from v41jax.sweep.driver import train_timing
from v41jax.train import train
from v41jax.train.metrics import read_metrics
from v41jax.train.steploop import Cadence, RunLog, log_gaps, step_ranges

FAST = ["train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), FAST + list(extra))


def _write_log(path, steps, cut=None):
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": float(s), "tokens_per_s": 100.0}) + "\n")
        if cut is not None:
            f.write(cut)


def test_step_ranges():
    assert step_ranges([24, 21, 22, 23, 30, 32, 33]) == "21-24, 30, 32-33"
    assert step_ranges([]) == ""


@pytest.mark.parametrize(
    "kept, cut, missing",
    [
        (range(1, 24), '{"step": 24, "loss": 3.1', [24]),  # the last line cut
        (range(1, 21), '{"step": 21, "lo', [21, 22, 23, 24]),  # cut, and lines lost after it
        (range(1, 21), '{"st', [21, 22, 23, 24]),  # the step is gone from the cut line too
    ],
)
def test_a_cut_log_names_the_steps_it_lacks(tmp_path, capsys, kept, cut, missing):
    _write_log(tmp_path / "metrics.jsonl", kept, cut)
    cadence = Cadence(steps=30, log_every=1, eval_every=0, checkpoint_every=4)
    log = RunLog(tmp_path, 24, enabled=True, tensorboard=False, cadence=cadence)
    log({"step": 25, "loss": 2.0, "tokens_per_s": 100.0})
    log.close()
    err = capsys.readouterr().err
    assert "cut short (a kill mid-write" in err and "kept in metrics.jsonl.after_24" in err, err
    named = f"step {missing[0]} has" if len(missing) == 1 else f"steps {step_ranges(missing)} have"
    assert f"{named} no train line" in err, err
    rows = read_metrics(tmp_path / "metrics.jsonl")  # parses: the cut line is gone
    note = [r for r in rows if "log_note" in r]
    assert len(note) == 1 and note[0]["step"] == 24 and note[0]["missing_train_steps"] == missing
    assert [r["step"] for r in rows if "loss" in r] == [*kept, 25]
    assert (tmp_path / "metrics.jsonl.after_24").read_text() == cut + "\n"  # kept, not lost
    assert train_timing(rows, 100)["wall_s"] > 0  # the sweep's reader takes it


def test_without_the_cadence_the_cut_lines_step_is_still_named(tmp_path, capsys):
    _write_log(tmp_path / "metrics.jsonl", range(1, 24), '{"step": 24, "loss": 3.1')
    RunLog(tmp_path, 24, enabled=True, tensorboard=False).close()
    assert "step 24 has no train line" in capsys.readouterr().err


def test_a_clean_resume_says_nothing_but_what_it_moves_aside(tmp_path, capsys):
    _write_log(tmp_path / "metrics.jsonl", range(1, 25))
    cadence = Cadence(steps=30, log_every=1, eval_every=0, checkpoint_every=4)
    RunLog(tmp_path, 24, enabled=True, tensorboard=False, cadence=cadence).close()
    assert capsys.readouterr().err == ""
    RunLog(tmp_path, 20, enabled=True, tensorboard=False, cadence=cadence).close()
    err = capsys.readouterr().err
    assert err.strip() == (
        "metrics.jsonl: the lines of steps 21-24 are moved to metrics.jsonl.after_20: the run "
        "resumes from checkpoint 20 and trains those steps again"
    )
    assert "warning" not in err and "log_note" not in (tmp_path / "metrics.jsonl").read_text()


def test_log_gaps_respects_the_cadence():
    from v41jax.train.metrics import ResumedLog

    found = ResumedLog(24, "m.after_24", (), (), (10, 20))
    every10 = Cadence(steps=24, log_every=10, eval_every=0, checkpoint_every=4).logs
    assert log_gaps(found, every10)[1] == [24]  # the last step logs; 21-23 never did
    assert log_gaps(found, None) == ([], [])


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run4") / "tiny")
    train(tiny("train.steps=4"), workdir, progress=False)
    return workdir


def _cut_in_train_line(workdir, step):
    """Cut metrics.jsonl in the middle of `step`'s train line (what follows is lost too)."""
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    i = next(i for i, ln in enumerate(lines) if json.loads(ln)["step"] == step)
    with open(path, "w") as f:
        f.write("".join(lines[:i]) + lines[i][: len(lines[i]) // 2])


def test_a_resume_after_a_cut_log_says_so_and_goes_on(run4, tmp_path, capsys):
    workdir = str(tmp_path / "run")
    shutil.copytree(run4, workdir)
    _cut_in_train_line(workdir, 4)
    train(tiny("train.steps=6"), workdir, progress=False)  # resumes at 4: 4 is not retrained
    err = capsys.readouterr().err
    assert "its last line was cut short (a kill mid-write; step 4)" in err, err
    assert "step 4 has no train line" in err, err
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 5, 6]
    assert [r["missing_train_steps"] for r in rows if "log_note" in r] == [[4]]


def test_a_resume_from_an_older_checkpoint_retrains_one_line_per_step(run4, tmp_path, capsys):
    """Checkpoint 4 lost: the run resumes from 2; the lines of 3-4 (one cut) move aside and
    steps 3-4 are logged again, once each."""
    workdir = str(tmp_path / "run")
    shutil.copytree(run4, workdir)
    _cut_in_train_line(workdir, 4)
    shutil.move(os.path.join(workdir, "checkpoints", "4"), str(tmp_path / "elsewhere"))
    train(tiny("train.steps=4"), workdir, progress=False)
    err = capsys.readouterr().err
    assert "the lines of step 3 are moved to metrics.jsonl.after_2" in err, err
    assert "cut short" in err and "no train line" not in err, err
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    aside = (tmp_path / "run" / "metrics.jsonl.after_2").read_text().splitlines()
    assert json.loads(aside[0])["step"] == 3 and aside[1].startswith('{"step": 4')
