"""Where a setting's runs and results go: only the full setting writes an experiment's
committed results/ by default; a runs dir holds the runs of one setting; a refused sweep
changes nothing."""

import json
import os

import pytest

from v41jax.__main__ import main
from v41jax.sweep import default_runs_dir, experiment_dirs, record_setting, recorded_setting


def test_only_the_full_setting_writes_the_committed_results():
    assert default_runs_dir("experiments/engram_vs_ffn/config.py") == "runs/engram_vs_ffn"
    assert default_runs_dir("experiments/engram_vs_ffn", "mini") == "runs/engram_vs_ffn_mini"
    assert experiment_dirs("experiments/dspark", "full") == (
        "runs/dspark",
        "experiments/dspark/results",
    )
    assert experiment_dirs("experiments/dspark", "quick") == (
        "runs/dspark_quick",
        "runs/dspark_quick/results",
    )
    assert experiment_dirs("experiments/dspark", "quick", "r", None) == ("r", "r/results")
    assert experiment_dirs("experiments/dspark", "quick", "r", "o") == ("r", "o")


def test_a_runs_dir_holds_one_setting(tmp_path):
    runs = str(tmp_path / "runs")
    assert recorded_setting(runs) is None
    record_setting(runs, "experiments/x/config.py", "mini")
    record_setting(runs, "experiments/x/config.py", "mini")  # the same: fine
    assert recorded_setting(runs) == "mini"
    with pytest.raises(ValueError, match="holds the runs of setting 'mini', not 'full'"):
        record_setting(runs, "experiments/x/config.py", "full")
    path = os.path.join(runs, "sweep.json")
    with open(path, "r+b") as f:  # cut short: named, with the hint
        f.truncate(os.path.getsize(path) // 2)
    for call in (lambda: recorded_setting(runs), lambda: record_setting(runs, "x.py", "mini")):
        with pytest.raises(ValueError, match=f"{path} is not valid JSON .* may be cut short"):
            call()


SWEEP = """
from v41jax import config as config_lib
from v41jax.sweep import RunSpec

SETTINGS = ("toy",)


def get_sweep(setting="toy"):
    cfg = config_lib.override(
        config_lib.get_config("tiny"), ["train.steps=2", "train.eval_every=0", "optim.lr=LR"]
    )
    return [RunSpec("s", "a", 0, cfg)]
"""


def test_a_refused_sweep_writes_nothing(tmp_path, capsys):
    """A sweep whose run dir holds another config is refused before any file is written
    (not even the runs dir's sweep.json)."""
    from v41jax import config as config_lib

    path = tmp_path / "sweep.py"
    path.write_text(SWEEP.replace("LR", "0.1"))
    runs = tmp_path / "runs"
    workdir = runs / "s" / "a_seed0"
    workdir.mkdir(parents=True)
    other = config_lib.override(config_lib.get_config("tiny"), ["train.steps=2"])
    config_lib.save_json(other, str(workdir / "config.json"))
    before = sorted(os.listdir(runs)), (workdir / "config.json").read_text()
    argv = ["sweep", str(path), "--setting", "toy", "--runs-dir", str(runs), "--no-progress"]
    assert main(argv) == 2
    assert "different config" in capsys.readouterr().err
    assert (sorted(os.listdir(runs)), (workdir / "config.json").read_text()) == before
    assert not (runs / "sweep.json").exists()
    json.loads((workdir / "config.json").read_text())  # intact


def test_a_refused_report_writes_nothing(tmp_path, capsys):
    """A report asked for another setting than its runs dir holds, or for runs that do not
    exist, is an error before any results folder is made."""
    exp, runs = tmp_path / "exp", str(tmp_path / "runs")
    exp.mkdir()
    record_setting(runs, "experiments/x/config.py", "mini")
    argv = ["report", str(exp), "--runs-dir", runs, "--setting", "full", "--quiet"]
    assert main(argv) == 2
    assert "holds the runs of setting 'mini', not 'full'" in capsys.readouterr().err
    assert main(["report", str(exp), "--runs-dir", str(tmp_path / "none"), "--quiet"]) == 2
    assert "no runs in" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["exp", "runs"] and os.listdir(exp) == []
    assert os.listdir(runs) == ["sweep.json"]
