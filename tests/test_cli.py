"""The CLI end to end, as the README shows it: train (the issue's exact command), eval, generate."""

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "v41jax", *args], capture_output=True, text=True, timeout=300
    )


def _train(workdir):
    """The issue's exact command."""
    return _run(
        "train",
        "--config",
        "tiny",
        "--workdir",
        workdir,
        "--set",
        "train.steps=24",
        "--set",
        "train.checkpoint_every=4",
        "--set",
        "train.log_every=1",
    )


@pytest.mark.e2e
def test_train_eval_generate(tmp_path):
    workdir = str(tmp_path / "run")
    train = _train(workdir)
    assert train.returncode == 0, train.stderr
    with open(f"{workdir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 25))
    assert rows[-1]["step"] == 24 and "val_loss" in rows[-1]
    assert "train tiny" in train.stderr  # the tqdm progress bar

    ev = _run("eval", "--workdir", workdir)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["val_loss"] == rows[-1]["val_loss"]

    gen = _run(
        "generate",
        "--workdir",
        workdir,
        "--prompt",
        "The Congress",
        "--prompt",
        "We",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.count("--- step 24") == 2 and "The Congress" in gen.stdout

    again = _train(workdir)
    assert again.returncode == 0 and "resumed from" in again.stdout  # finished: just evaluates


@pytest.mark.e2e
def test_errors_are_one_clear_line(tmp_path):
    missing = _run("generate", "--workdir", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no run" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad_cfg = _run("train", "--config", "nope", "--workdir", str(tmp_path / "w"))
    assert bad_cfg.returncode == 2 and "unknown config 'nope'" in bad_cfg.stderr
