"""The stop on SIGTERM / Ctrl-C, agreed by every process of the job.

Each process latches the signal itself (`StopSignal`). On one process the loop stops after
the step during which the signal arrived, saves that step and exits 0.

On several hosts the signal reaches the processes at different moments (a preempted TPU
slice sends SIGTERM to every host within seconds of each other, or a scheduler stops one
process only). A process that stopped on its own would leave the others blocked in the next
step's collectives, and a checkpoint would be written by some processes and not others.
So the processes agree: every `every` steps each one contributes its flag to one small
collective (`any_process`: `multihost_utils.process_allgather` of one int32 per process),
and if any process has seen a signal, all of them stop after that same step, save the same
checkpoint (orbax's multi-process save: each process writes its shards, the primary
commits the step) and exit 0. The steps at which they agree are multiples of `every`, which
every process knows without asking, so each calls the collective at the same steps, and a
process that saw no signal stops too.

A check makes the host wait for the step before it (the collective runs after it on the
device), which costs a little overlap of host and device, hence every 10 steps by default
(`--set train.stop_check_every=n` to change it). A signal is then acted on within `every`
steps: choose `every` so that those steps and a checkpoint fit in the grace period between
SIGTERM and SIGKILL (30 s on a preempted Cloud VM).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from v41jax.config.schema import TrainConfig
from v41jax.train.checkpoint import StopSignal

DEFAULT_EVERY = TrainConfig.stop_check_every  # the config default, one source


def any_process(flag: bool, process_count: int | None = None, gather=None) -> bool:
    """True on every process when `flag` is True on any of them. A collective when there are
    several processes: every process must call it at the same point of the program.

    process_count and gather (`multihost_utils.process_allgather`: one row per process) are
    the job's unless given, so a test can play several processes on one."""
    count = jax.process_count() if process_count is None else process_count
    if count == 1:
        return bool(flag)
    if gather is None:
        from jax.experimental import multihost_utils

        gather = multihost_utils.process_allgather
    flags = np.asarray(gather(np.asarray([int(flag)], np.int32)))
    return bool(flags.any())


class AgreedStop:
    """`stop(step)`: whether every process stops after `step` (see the module docstring).

    process_count and reduce are the job's (`jax.process_count()`, `any_process`) unless
    given; a test passes its own to play several processes on one."""

    def __init__(
        self,
        latch: StopSignal,
        every: int = DEFAULT_EVERY,
        process_count: int | None = None,
        reduce: Callable[[bool], bool] = any_process,
    ):
        self.latch = latch
        self.every = every
        if self.every < 1:
            raise ValueError(f"AgreedStop: every={self.every} must be >= 1")
        self.process_count = jax.process_count() if process_count is None else process_count
        self.reduce = reduce

    @property
    def received(self) -> int | None:
        """The signal this process saw (None when only another process saw one)."""
        return self.latch.received

    def __call__(self, step: int) -> bool:
        seen = self.latch.received is not None
        if self.process_count == 1:  # nothing to agree: stop after this very step
            return seen
        if step % self.every:
            return False
        return bool(self.reduce(seen))

    def describe(self, step: int) -> str:
        """The log line of a stop at `step`."""
        here = self.received is not None
        why = f"signal {self.received}" if here else "a signal on another process"
        return f"stopped by {why} at step {step}; checkpoint saved"
