"""experiments/engram_scale: the grid of cells, and (slow) the quick setting end to end: every
cell trains and decodes, host-table cells reach the device cells' validation loss with the
same sparse optimizer, file cells hold only the rows training wrote, the plots are written."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXP = os.path.join(ROOT, "experiments", "engram_scale")


def _module(name):
    spec = importlib.util.spec_from_file_location(f"engram_scale_{name}", f"{EXP}/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_grid_goes_past_ram_only_in_files_and_adam_stays_on_device():
    c = _module("config")
    cells = c.cells("full")
    assert max(s for s, p, _ in cells if p == "file") >= 1e10  # 40 GB of rows > 24 GiB RAM
    assert max(s for s, p, _ in cells if p != "file") <= 1e9
    assert not [x for x in cells if x[2] == "adam" and x[1] != "device"]
    assert len({c.cell_name(x) for x in cells}) == len(cells)
    cfg = c.get_config((1e8, "file", "rowwise_adagrad"))
    assert cfg.model.engram.table_path == "tables"
    assert cfg.model.engram.table_placement == "host"
    assert cfg.optim.table_optimizer == "rowwise_adagrad"


@pytest.mark.e2e
@pytest.mark.slow
def test_the_quick_setting_end_to_end(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, os.path.join(EXP, "run.py"), "--setting", "quick", "--runs-dir",
           str(tmp_path / "runs"), "--out-dir", str(out), "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3000)
    cells = json.loads((out / "summary.json").read_text())["cells"]
    assert len(cells) == len(_module("config").cells("quick"))
    by = {(e["table_params"], e["placement"], e["optimizer"]): e for e in cells}
    for (size, place, opt), e in by.items():
        assert e["decode_tok_s_b1"] > 0 and e["decode_tok_s_b8"] > 0 and e["step_ms"] > 0
        if place == "host":  # the same run as its device cell, step for step
            assert abs(e["val_loss"] - by[(size, "device", opt)]["val_loss"]) < 1e-4
            assert e["host_bytes"] > 0
        if place == "file":
            assert 0 < e["disk_bytes"]
            assert e["device_bytes"] == by[(size, "host", opt)]["device_bytes"]
    for name in ("step_time", "val_loss", "decode"):
        assert (out / f"{name}.png").stat().st_size > 1000
    assert (out / "tables.md").read_text().count("\n| ") == len(cells) + 1


def test_a_stopped_cell_is_not_measured_and_the_command_exits_1(tmp_path, monkeypatch, capsys):
    """SIGTERM / Ctrl-C stop training with a checkpoint (train returns "stopped"): run.py
    says how to resume and exits 1 instead of measuring a run that has no val loss."""
    run = _module("run")
    monkeypatch.setattr(run, "train", lambda cfg, workdir, progress: {"step": 3, "stopped": True})
    args = ["--setting", "quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir",
            str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert run.main(args) == 1
    assert "stopped at step 3 of" in capsys.readouterr().out
    assert not list((tmp_path / "runs").rglob("cell.json"))
