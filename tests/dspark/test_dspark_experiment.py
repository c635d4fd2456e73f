"""The DSpark experiment end to end in miniature (slow: trains a tiny target, its post-trained
stand-in and three drafters, then decodes): every decoder at every batch size is timed, the
drafters' statistics, the realignment, scheduler and temperature studies and the four
target checks are reported."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.e2e
@pytest.mark.slow
def test_dspark_experiment_miniature(tmp_path):
    out = tmp_path / "results"
    script = os.path.join(ROOT, "experiments", "dspark", "run.py")
    cmd = [
        sys.executable,
        script,
        "--quick",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=1200)
    summary = json.loads((out / "summary.json").read_text())
    decoders = {(r["name"], r["batch"]) for r in summary["rows"]}
    for b in (1, 4):
        for name in ("plain", "mtp1 fixed", "parallel fixed", "dspark fixed", "dspark scheduled"):
            assert (name, b) in decoders
    assert all(r["tokens_per_s"] > 0 for r in summary["rows"])
    for name in ("mtp1 fixed", "parallel fixed", "dspark fixed", "dspark scheduled"):
        stats = summary["stats"][name]
        assert stats["tokens_per_round"] >= 1 and 0 <= stats["calibration"]["ece"] <= 1
    assert len(summary["stats"]["mtp1 fixed"]["acceptance"]) == 1
    assert set(summary["realignment"]) == {"before", "after"}
    study = summary["scheduler_study"]["configs"]
    fixed = {f"fixed L={k}" for k in range(1, 6)}
    assert set(study) == fixed | {f"{n}, host loop" for n in fixed} | {"scheduled"}
    assert all(len(v["tokens_per_s"]) == 2 for v in study.values())
    assert all(v["loop_rounds"] >= v["row_rounds"] > 0 for v in study.values())
    replay = summary["scheduler_study"]["replay"]
    assert len(replay["fixed"]) == 5 and replay["rounds"] > 0
    assert set(replay["scheduled"]) == {"width", "padded"}
    assert replay["oracle"] >= max(replay["fixed"] + list(replay["scheduled"].values())) - 1e-9
    assert set(summary["temperature_study"]) == {"0.0", "1.0"}
    assert set(summary["temperature_study"]["0.0"]) == {"mtp1", "parallel", "dspark"}
    tables = (out / "tables.md").read_text()
    assert (
        "The issue's targets" in tables
        and "Scheduler vs fixed verify length" in tables
        and "Tokens per round by temperature" in tables
        and "Replay: width policies" in tables
        and tables.count("| True |") + tables.count("| False |") == 4
    )
    for png in ("acceptance.png", "reliability.png", "throughput.png"):
        assert (out / png).stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_dspark_deep_experiment_miniature(tmp_path):
    """experiments/dspark_deep in miniature: costs c and v(L) with their ceilings, every
    decoder at every batch and temperature with its speedup over plain decoding from the same
    passes, the scheduler study with the replay, the target checks and the plots."""
    out = tmp_path / "results"
    script = os.path.join(ROOT, "experiments", "dspark_deep", "run.py")
    cmd = [sys.executable, script, "--quick", "--runs-dir", str(tmp_path / "runs")]
    subprocess.run(cmd + ["--out-dir", str(out)], check=True, cwd=ROOT, timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["wall_clock"]
    decoders = [d[0] for d in summary["settings"]["DECODERS"]]
    assert {(r["decoder"], r["batch"], r["temperature"]) for r in rows} == {
        (d, b, t) for d in decoders for b in (1, 4) for t in (1.0, 0.0)
    }
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup_vs_plain"] > 0
        if r["decoder"] == "plain":
            assert r["speedup_vs_plain"] == 1.0
    for name, by_b in summary["cost_units"].items():
        k = len(summary["stats"][name]["acceptance"])
        for u in by_b.values():
            assert u["c"] > 0 and len(u["v"]) == k and len(u["ceiling"]) == k
    study = summary["scheduler_study"]["4"]
    assert {"plain", "scheduled", "fixed L=1"} <= set(study["configs"])
    assert study["replay"]["oracle"] >= max(study["replay"]["fixed"]) - 1e-9
    tables = (out / "tables.md").read_text()
    assert "## Targets" in tables and "ceiling L=1" in tables
    for png in ("acceptance.png", "reliability.png", "throughput_t1.png", "throughput_greedy.png"):
        assert (out / png).stat().st_size > 0
