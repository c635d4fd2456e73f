"""Exact resume: SIGKILL / SIGTERM mid-run, rerun the same command, same per-step losses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

STEPS = 40


def _cmd(workdir):
    return [
        sys.executable,
        "-m",
        "v41jax",
        "train",
        "--config",
        "tiny",
        "--workdir",
        str(workdir),
        "--set",
        f"train.steps={STEPS}",
        "--set",
        "train.checkpoint_every=4",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=0",
        "--no-progress",
    ]


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _run_until_then_signal(workdir, sig, at_step):
    proc = subprocess.Popen(_cmd(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and max(_losses(workdir), default=0) >= at_step:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    out = proc.communicate(timeout=240)[0].decode()
    return proc.returncode, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(_cmd(workdir), check=True, capture_output=True)
    losses = _losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_run_resumes_with_identical_losses(tmp_path, reference, sig):
    rc, out = _run_until_then_signal(tmp_path, sig, at_step=10)
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, out
    else:  # SIGTERM: the loop saves a checkpoint at the step boundary and exits cleanly
        assert rc == 0 and "stopped by signal" in out, out
    killed_at = max(_losses(tmp_path))
    assert killed_at < STEPS, "the run finished before the signal; nothing was tested"
    ckpts = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    if sig == signal.SIGTERM:
        assert ckpts[-1] == killed_at  # saved exactly where it stopped
    rerun = subprocess.run(_cmd(tmp_path), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed from" in rerun.stdout
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(resumed[step] - reference[step]) <= 1e-6, (step, resumed[step], reference[step])
