"""The verify benchmark runs and reports every variant; the throughput experiment's miniature
(slow: trains two tiny models) regenerates its summary, table and plots."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from v41jax.bench import verify_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_verify_bench_reports_every_variant(tmp_path, capsys):
    path = tmp_path / "verify.json"
    args = argparse.Namespace(
        batch=4, drafts=2, vocabs="300,1000", iters=1, rounds=1, quick=False, json=str(path)
    )
    assert verify_bench.run(args) == 0
    rows = json.loads(path.read_text())["rows"]
    variants = {(r["variant"], r["V"]) for r in rows}
    for v in (300, 1000):
        assert {("bound", v), ("xla", v), ("race_row", v), ("common", v), ("pallas", v)} <= variants
    bound = [r for r in rows if r["variant"] == "bound"]
    assert all(r["ratio_to_bound"] == 1.0 and r["read_GBps"] > 0 for r in bound)
    assert "ratio_to_bound" in capsys.readouterr().out


def test_common_approach_emits_valid_rounds():
    import jax
    import numpy as np

    drafts, q, p = verify_bench.make_inputs(16, 3, 50)
    out, acc = verify_bench.common_approach(jax.random.key(0), drafts, q, p)
    out, acc = np.asarray(out), np.asarray(acc)
    for row in range(16):
        a = acc[row]
        assert np.array_equal(out[row, :a], np.asarray(drafts)[row, :a])
        assert 0 <= out[row, a] < 50 and np.all(out[row, a + 1 :] == -1)


@pytest.mark.e2e
@pytest.mark.slow
def test_speculative_throughput_experiment_miniature(tmp_path):
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "spec_throughput", "run.py"),
        "--quick",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert all(abs(r["z"]) < 5 for r in summary["monte_carlo"])
    rows = summary["real"]["rows"]
    assert rows and all(r["tokens_per_round"] >= 1 and r["speedup_measured"] > 0 for r in rows)
    assert (out / "tokens_per_round.png").stat().st_size > 0
    assert (out / "real_run.png").stat().st_size > 0
