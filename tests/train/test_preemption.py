"""The stop on SIGTERM agreed by every process: a signal on any process stops all of them
after the same step (played here with a fake process count and gather); on one process the
stop is the signal's own step, as before (the SIGTERM resume test runs the real loop)."""

import os
import signal

import numpy as np
import pytest

from v41jax.train.checkpoint import StopSignal
from v41jax.train.preemption import AgreedStop, any_process


class Latch:  # a StopSignal as the loop sees it
    def __init__(self):
        self.received = None


def fake_gather(others):
    """process_allgather of 1 + len(others) processes: this one's row, then the others'."""

    def gather(row):
        rows = [np.asarray(row)] + [np.asarray([int(f)], np.int32) for f in others]
        return np.stack(rows)

    return gather


def test_any_process_reduces_every_process_flag():
    assert any_process(True, process_count=1) and not any_process(False, process_count=1)
    assert any_process(False, process_count=4, gather=fake_gather([False, True, False]))
    assert any_process(True, process_count=4, gather=fake_gather([False] * 3))
    assert not any_process(False, process_count=4, gather=fake_gather([False] * 3))
    # jax's own process_allgather, on this single process
    assert any_process(True, process_count=2) and not any_process(False, process_count=2)


def test_a_signal_on_another_process_stops_this_one_at_the_agreed_step():
    latch, others = Latch(), [False, False, False]
    calls = []

    def reduce(seen):  # every process's flag: this one's and the fake others'
        calls.append(seen)
        return any_process(seen, process_count=4, gather=fake_gather(others))

    stop = AgreedStop(latch, every=5, process_count=4, reduce=reduce)
    assert [s for s in range(1, 11) if stop(s)] == []  # nobody saw a signal
    assert len(calls) == 2  # asked only at steps 5 and 10, as every process is
    others[1] = True  # process 2 is sent SIGTERM during step 11
    assert [stop(s) for s in (11, 12, 13, 14)] == [False] * 4 and len(calls) == 2
    assert stop(15) and "another process" in stop.describe(15)
    # a signal here: not acted on alone before the next agreed step
    latch2 = Latch()
    stop2 = AgreedStop(latch2, every=5, process_count=4, reduce=lambda seen: seen)
    latch2.received = signal.SIGTERM
    assert not stop2(16) and stop2(20)
    assert stop2.describe(20).startswith(f"stopped by signal {int(signal.SIGTERM)} at step 20")


def test_one_process_stops_after_the_step_that_saw_the_signal():
    def reduce(seen):
        raise AssertionError("no collective on one process")

    with StopSignal() as latch:
        stop = AgreedStop(latch, every=10, process_count=1, reduce=reduce)
        assert not stop(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop(4) and stop.received == signal.SIGTERM


def test_stop_check_every_is_a_validated_resumable_config_field():
    from v41jax import config as config_lib
    from v41jax.train.resume import RESUMABLE_FIELDS

    tiny = config_lib.get_config("tiny")
    assert tiny.train.stop_check_every == 10 and AgreedStop(Latch(), process_count=2).every == 10
    cfg = config_lib.override(tiny, ["train.stop_check_every=3"])
    assert AgreedStop(Latch(), every=cfg.train.stop_check_every, process_count=2).every == 3
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match=f"train.stop_check_every={bad} must be >= 1"):
            config_lib.override(tiny, [f"train.stop_check_every={bad}"])
    with pytest.raises(ValueError, match="every=0"):
        AgreedStop(Latch(), every=0)
    assert "train.stop_check_every" in RESUMABLE_FIELDS
