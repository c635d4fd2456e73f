"""Observability of a run: TensorBoard scalars beside metrics.jsonl (purged past the resume
step), a profiler trace of the chosen steps, per-module gradient and update norms, model
FLOP/s in the log and MFU given a peak, the persistent compilation cache."""

import glob
import os
import struct
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from v41jax import config as config_lib
from v41jax.model.accounting import model_flops_per_token
from v41jax.train import train
from v41jax.train.metrics import read_metrics
from v41jax.train.observe import TensorBoard, peak_flops_per_device


def events(directory):
    """Every Event of the TFRecord event files in `directory`, file by file."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            out.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return out


def scalars(directory, tag):
    return {
        e.step: v.simple_value for e in events(directory) for v in e.summary.value if v.tag == tag
    }


def test_a_run_logs_tensorboard_flops_mfu_and_a_profile(tmp_path):
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        ["train.steps=4", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=4",
         "train.profile_steps=2,3", "train.peak_flops=1e12"],
    )  # fmt: skip
    train(cfg, str(tmp_path), progress=False)
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    logged = [r for r in rows if "loss" in r]
    per_token = model_flops_per_token(cfg.model, cfg.data.seq_len)
    for r in logged:
        modules = [k for k in r if k.startswith("grad_norm/")]
        assert {"grad_norm/embed", "grad_norm/final_norm"} <= set(modules)
        assert sum(r[k] ** 2 for k in modules) == pytest.approx(r["grad_norm"] ** 2, rel=1e-4)
        assert r["update_norm/embed"] >= 0 and "update_norm/final_norm" in r
        assert r["model_flops_per_s"] == pytest.approx(r["tokens_per_s"] * per_token)
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / (1e12 * jax.device_count()))
    assert logged[-1]["update_norm/embed"] > 0  # step 1 runs at lr 0 (warmup)
    board = str(tmp_path / "tensorboard")
    loss = scalars(board, "train/loss")
    assert sorted(loss) == [1, 2, 3, 4]
    np.testing.assert_allclose([loss[s] for s in range(1, 5)], [r["loss"] for r in logged])
    assert scalars(board, "eval/val_loss") == {4: pytest.approx(rows[-1]["val_loss"])}
    assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)


def test_a_resumed_board_purges_what_a_killed_run_wrote_past_its_checkpoint(tmp_path):
    first = TensorBoard(str(tmp_path), 0)
    for step in range(1, 6):
        first.write({"step": step, "loss": float(step), "note": "x", "stopped": True})
    first.close()
    again = TensorBoard(str(tmp_path), 3)
    again.write({"step": 4, "loss": 40.0})
    again.close()
    evs = events(str(tmp_path))
    purge = [e for e in evs if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in purge][-1] == (4, event_pb2.SessionLog.START)
    tags = {v.tag for e in evs for v in e.summary.value}
    assert tags == {"train/loss"}  # strings and booleans are not scalars
    with pytest.raises(ValueError, match="profile_steps"):
        config_lib.override(config_lib.get_config("tiny"), ["train.profile_steps=3,2"])


def test_peak_flops_by_device_kind():
    cfg = config_lib.get_config("tiny")
    kind = lambda k: types.SimpleNamespace(device_kind=k)  # noqa: E731
    assert peak_flops_per_device(cfg, kind("TPU v5 lite")) == 197e12
    assert peak_flops_per_device(cfg, kind("NVIDIA H200")) == 989e12
    assert peak_flops_per_device(cfg, kind("cpu")) is None
    set_peak = config_lib.override(cfg, ["train.peak_flops=5e14"])
    assert peak_flops_per_device(set_peak, kind("cpu")) == 5e14


@pytest.mark.e2e
def test_runs_fill_a_persistent_compilation_cache_unless_told_not_to(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("V41JAX_COMPILATION_CACHE", None)
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "v41jax", "train", "--config", "tiny", "--no-progress",
            "--set", "train.steps=2", "--set", "train.eval_every=0",
            "--set", f"train.compilation_cache={cache}"]  # fmt: skip
    run = lambda w, **e: subprocess.run(  # noqa: E731
        [*argv, "--workdir", str(tmp_path / w)], env={**env, **e}, capture_output=True,
        timeout=600, check=True,
    )  # fmt: skip
    run("off", V41JAX_COMPILATION_CACHE="off")
    assert not cache.exists()
    run("on")
    assert len(os.listdir(cache)) >= 1  # the train step's executable, among others
