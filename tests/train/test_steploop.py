"""The one step loop (`v41jax.train.steploop`): when a run logs, evaluates and checkpoints,
and where it stops on a signal."""

import os
import signal

import pytest

from v41jax.train.steploop import Cadence, RunLog, run_steps


def _due(fn, steps):
    return [s for s in range(1, steps + 1) if fn(s)]


def test_cadence_ends_with_everything():
    c = Cadence(steps=7, log_every=3, eval_every=0, checkpoint_every=5)
    assert _due(c.logs, 7) == [3, 6, 7]
    assert _due(c.evaluates, 7) == [7]  # eval_every = 0: only the last step
    assert _due(c.saves, 7) == [5, 7]
    c = Cadence(steps=7, log_every=1, eval_every=2, checkpoint_every=7)
    assert _due(c.logs, 7) == list(range(1, 8))
    assert _due(c.evaluates, 7) == [2, 4, 6, 7]
    assert _due(c.saves, 7) == [7]


def test_run_steps_runs_each_step_once_from_the_resume_point():
    seen, stops = [], []
    out = run_steps(3, 8, lambda s, bar: seen.append(s), stops.append, desc="t", progress=False)
    assert out is None and seen == [4, 5, 6, 7, 8] and stops == []
    assert run_steps(8, 8, lambda s, bar: seen.append(s), stops.append, desc="t") is None
    assert seen == [4, 5, 6, 7, 8]  # nothing left to run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_it_arrives_in(sig):
    seen, stops = [], []

    def body(step, bar):
        seen.append(step)
        if step == 3:
            os.kill(os.getpid(), sig)  # delivered to the latch before the stop check

    previous = signal.getsignal(sig)
    out = run_steps(0, 10, body, stops.append, desc="t", progress=False)
    assert out == 3 and seen == [1, 2, 3] and stops == [3]
    assert signal.getsignal(sig) is previous  # the handlers are given back


def test_run_log_writes_metrics_and_tensorboard(tmp_path):
    log = RunLog(tmp_path, 0, enabled=True)
    log({"step": 1, "loss": 2.5})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step": 1, "loss": 2.5}'
    assert any((tmp_path / "tensorboard").iterdir())
    off = tmp_path / "off"
    RunLog(off, 0, enabled=False)({"step": 1, "loss": 1.0})
    assert not off.exists()
