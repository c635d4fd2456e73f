"""experiments/engram_optim: the grid (stage 1, then the other seeds at each arm's best lr),
the configs it trains, the report's best-lr choice and target verdict, and (slow) the quick
setting end to end."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from v41jax.engram.primes import stored_table_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXP = os.path.join(ROOT, "experiments", "engram_optim")


def _module(name):
    spec = importlib.util.spec_from_file_location(f"engram_optim_{name}", f"{EXP}/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_full_grid_and_its_configs():
    c = _module("config")
    first = c.first_stage("full")
    arms = {c.arm(r) for r in first}
    assert len(first) == 2 * 7 * 3 and len(arms) == 14  # sizes x (6 optimizers + v41) x lrs
    assert {r[4] for r in first} == {0} and len({c.run_name(r) for r in first}) == len(first)
    best = {a: 3e-3 for a in arms}
    second = c.second_stage("full", best)
    assert len(second) == 14 and {(r[3], r[4]) for r in second} == {(3e-3, 1)}
    assert c.second_stage("full", {}) == []  # nothing before stage 1 is measured
    for size in (1e6, 1e8):
        cfg = c.get_config((size, "sinkhorn_sparse", "adamw", 1e-2, 1))
        engram = cfg.model.engram
        params = sum(stored_table_rows(engram, x) * engram.head_dim for x in engram.layer_ids)
        assert 0.9 * size < params < 1.2 * size, params  # "about" the size
        assert cfg.model.d_model == 256 and cfg.train.steps >= 1000 and len(engram.layer_ids) == 2
        assert cfg.optim.table_optimizer == "sinkhorn_sparse" and cfg.optim.lr == 1e-2
        assert cfg.train.seed == cfg.data.seed == 1
    adam = c.get_config((1e6, "adam", "adamw", 1e-3, 0))
    adam5 = c.get_config((1e6, "adam_5x", "adamw", 1e-3, 0))
    assert (adam.model.engram.table_lr_scale, adam5.model.engram.table_lr_scale) == (1.0, 5.0)
    v41 = c.get_config((1e6, "sinkhorn", "v41", 1e-3, 0))
    assert v41.optim.recipe == "v41" and v41.optim.tables_trained_by == "sinkhorn"


def _row(size, opt, lr, seed, val, recipe="adamw"):
    return {"optimizer": opt, "recipe": recipe, "placement": "device", "table_params": size,
            "lr": lr, "seed": seed, "steps": 10, "val_loss": val, "rare_loss": val + 1,
            "state_bytes": 100, "table_state_bytes": 50, "step_ms": 10.0}  # fmt: skip


def test_the_report_picks_the_best_lr_at_seed_0_and_says_whether_the_target_is_met():
    r = _module("report")
    runs = [
        _row(1e6, "adam_5x", 1e-3, 0, 4.00), _row(1e6, "adam_5x", 3e-3, 0, 3.90),
        _row(1e6, "adam_5x", 3e-3, 1, 3.94), _row(1e6, "adam", 3e-3, 0, 3.95),
        _row(1e6, "sparse_adam", 1e-3, 0, 3.93), _row(1e6, "sparse_adam", 3e-3, 0, 3.96),
        _row(1e6, "sparse_adam", 3e-3, 1, 3.80),  # a lucky second seed at a worse lr: unused
        _row(1e8, "adam", 3e-3, 0, 3.50), _row(1e8, "rowwise_adagrad", 3e-3, 0, 3.60),
    ]  # fmt: skip
    best = r.best_rows(runs)
    assert best[(1e6, "adam_5x")]["lr"] == 3e-3 and best[(1e6, "adam_5x")]["seeds"] == [0, 1]
    assert best[(1e6, "adam_5x")]["val"] == pytest.approx(3.92)
    assert best[(1e6, "sparse_adam")]["lr"] == 1e-3 and best[(1e6, "sparse_adam")]["seeds"] == [0]
    summary = {
        "setting": "full", "grid": {"base": "small", "layers": [1, 2], "steps": 10,
        "lrs": [1e-3, 3e-3], "seeds": [0, 1]}, "machine": {"processor": "cpu", "cpu_count": 2},
        "commit": "abc", "runs": runs, "pending": [],
    }  # fmt: skip
    text = r.render_tables(summary)
    assert "`sparse_adam`, is +0.0100 nats from dense AdamW (meets the 0.02 target)" in text
    assert "`rowwise_adagrad`, is +0.1000 nats from dense AdamW (misses the 0.02 target)" in text
    assert "| 1e+06 | sparse_adam | 0.001 | 0 | 3.9300 | 0.0000 | +0.0100 |" in text
    assert "step ms: the runs' own medians" in text
    row = {"table_params": 1e6, "arm": "sparse_adam", "step_ms": 7.0, "vs_adam_5x": 0.7,
           "passes": 3, "state_bytes": 2**20, "table_state_bytes": 2**19}  # fmt: skip
    machine = {"processor": "cpu", "cpu_count": 2}
    timing = {"machine": machine, "commit": "abc", "rows": [row]}
    timed = r.render_tables(summary, timing)
    assert "step ms: side by side, `run.py --time`, cpu, commit abc" in timed
    assert "| 50.0 | 0.0 | 7 | 0.70x |" not in text and "| 7 | 0.70x |" in timed
    assert "| 1e+06 | sparse_adam | 7 | 0.70x | 1.0 | 0.5 |" in timed  # the cost table


@pytest.mark.e2e
@pytest.mark.slow
def test_the_quick_setting_end_to_end_and_resumes(tmp_path):
    out, runs_dir = tmp_path / "results", tmp_path / "runs"
    cmd = [sys.executable, os.path.join(EXP, "run.py"), "--setting", "quick", "--runs-dir",
           str(runs_dir), "--out-dir", str(out), "--no-progress"]  # fmt: skip
    subprocess.run([*cmd, "--limit", "3"], check=True, cwd=ROOT, timeout=3000)
    part = json.loads((out / "summary.json").read_text())
    assert len(part["runs"]) == 3 and part["pending"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3000)
    summary = json.loads((out / "summary.json").read_text())
    c = _module("config")
    assert len(summary["runs"]) == len(c.first_stage("quick")) + 7 and not summary["pending"]
    keys = {"optimizer", "recipe", "placement", "table_params", "lr", "seed", "steps",
            "val_loss", "rare_loss", "state_bytes", "step_ms"}  # fmt: skip
    for row in summary["runs"]:
        assert keys <= set(row) and row["step_ms"] > 0 and row["state_bytes"] > 0
    assert summary["runs"][:3] == part["runs"]  # the first three were measured once, kept
    for name in ("val_loss_vs_lr", "best"):
        assert (out / f"{name}.png").stat().st_size > 1000
    report = _module("report")
    assert (out / "tables.md").read_text() == report.render_tables(summary)
    subprocess.run([*cmd, "--time"], check=True, cwd=ROOT, timeout=3000)
    timing = json.loads((out / "timing.json").read_text())
    assert {row["arm"] for row in timing["rows"]} == set(report.ARMS)
    assert all(row["step_ms"] > 0 and row["vs_adam_5x"] > 0 for row in timing["rows"])
    rendered = subprocess.run([sys.executable, os.path.join(EXP, "report.py"), "--summary",
                               str(out / "summary.json")], check=True, cwd=ROOT)  # fmt: skip
    assert rendered.returncode == 0
    assert (out / "tables.md").read_text() == report.render_tables(summary, timing)


def test_a_stopped_run_is_not_measured_and_the_command_exits_1(tmp_path, monkeypatch, capsys):
    """SIGTERM / Ctrl-C stop training with a checkpoint (train returns "stopped"): run.py
    says how to resume and exits 1, measuring nothing."""
    run = _module("run")
    monkeypatch.setattr(run, "train", lambda cfg, workdir, progress: {"step": 5, "stopped": True})
    args = ["--setting", "quick", "--runs-dir", str(tmp_path / "runs"), "--out-dir",
            str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert run.main(args) == 1
    assert "stopped at step 5 of 1e05/adam_lr0.003_seed0: run the same command" in (
        capsys.readouterr().out
    )
    assert not list((tmp_path / "runs").rglob("cell.json"))


def test_committed_runs_are_reused_on_a_machine_with_an_empty_runs_dir(tmp_path):
    """summary.json is committed with the experiment: its finished runs are picked up by
    run key when the setting and grid match (a fresh clone continues the study), with the
    machine they ran on; another grid reuses nothing; a damaged file is named."""
    run, c = _module("run"), _module("config")
    grid = json.loads(json.dumps(c.SETTINGS["quick"]))
    row = {"optimizer": "adam", "recipe": "adamw", "placement": "device", "table_params": 1000,
           "lr": 0.001, "seed": 0, "val_loss": 3.5}  # fmt: skip
    summary = {"setting": "quick", "grid": grid, "machine": {"cpu": "old"},
               "runs": [row, {**row, "lr": 0.003, "machine": {"cpu": "other"}}]}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    got = run.committed_runs(str(tmp_path), "quick")
    assert set(got) == {(1000, "adam", "adamw", 0.001, 0), (1000, "adam", "adamw", 0.003, 0)}
    assert got[(1000, "adam", "adamw", 0.001, 0)]["machine"] == {"cpu": "old"}
    assert got[(1000, "adam", "adamw", 0.003, 0)]["machine"] == {"cpu": "other"}
    assert run.committed_runs(str(tmp_path), "full") == {}  # another setting
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "grid": {"steps": 1}}))
    assert run.committed_runs(str(tmp_path), "quick") == {}
    (tmp_path / "summary.json").write_text('{"runs": [')
    with pytest.raises(SystemExit, match="summary.json is damaged"):
        run.committed_runs(str(tmp_path), "quick")
    assert run.committed_runs(str(tmp_path / "none"), "quick") == {}
