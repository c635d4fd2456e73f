"""The one step loop both trainers run: `train` (`v41jax.train.loop`) and `train-drafter`
(`v41jax.dspark.train_shared`, one or several drafters against a frozen target).

    for s = start + 1 .. end:
        body(s)           # the step; its log line, evaluation and checkpoint when `Cadence` says
        if every process agrees to stop after s (SIGTERM / SIGINT, `preemption.AgreedStop`):
            on_stop(s)    # checkpoint s: the same command resumes exactly there
            return s

The trainers differ in what a step is (a train step, or one frozen-target pass shared by
several drafter updates), not in when they log, evaluate, checkpoint or stop: that is here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from v41jax.train.checkpoint import StopSignal
from v41jax.train.metrics import MetricsWriter
from v41jax.train.observe import TensorBoard
from v41jax.train.preemption import DEFAULT_EVERY, AgreedStop
from v41jax.train.workdir import as_path


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When a run of `steps` steps logs, evaluates and checkpoints (steps count from 1).

    The last step always does all three; `eval_every = 0` evaluates only there."""

    steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def of(cls, train_cfg: Any) -> Cadence:
        """From a config with these four fields (`TrainConfig`, `DrafterTrainConfig`)."""
        t = train_cfg
        return cls(t.steps, t.log_every, t.eval_every, t.checkpoint_every)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def evaluates(self, step: int) -> bool:
        return step == self.steps or bool(self.eval_every and step % self.eval_every == 0)

    def saves(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.steps


class RunLog:
    """A run's records, to WORKDIR/metrics.jsonl and WORKDIR/tensorboard together; later
    lines a killed run left after `start` are set aside (`MetricsWriter`, `TensorBoard`).
    Only the writing process (`enabled`) writes."""

    def __init__(self, workdir: Any, start: int, *, enabled: bool, tensorboard: bool = True):
        workdir = as_path(workdir)  # a local path or a gs:// URL alike
        self.metrics = MetricsWriter(workdir / "metrics.jsonl", start, enabled)
        self.board = TensorBoard(workdir / "tensorboard", start, enabled and tensorboard)

    def __call__(self, record: dict) -> None:
        self.metrics.write(record)
        self.board.write(record)

    def close(self) -> None:
        self.board.close()


def run_steps(
    start: int,
    end: int,
    body: Callable[[int, tqdm], None],
    on_stop: Callable[[int], None],
    *,
    desc: str,
    progress: bool = True,
    stop_check_every: int = DEFAULT_EVERY,
) -> int | None:
    """Run `body(s, bar)` for s = start + 1 .. end under a tqdm bar (`bar.set_postfix` /
    `bar.write` for the body's messages); returns the step it stopped at on a signal (after
    `on_stop(s)`), or None when it reached `end`.

    On one process a signal stops after the step it arrives in; on several, each process's
    latch is gathered every `stop_check_every` steps, so all stop after the same step and meet
    in the same checkpoint collective."""
    with (
        StopSignal() as signals,
        tqdm(total=end, initial=start, desc=desc, disable=not progress) as bar,
    ):
        stop = AgreedStop(signals, every=stop_check_every)
        for step in range(start + 1, end + 1):
            body(step, bar)
            bar.update(1)
            if stop(step):
                on_stop(step)
                bar.write(stop.describe(step))
                return step
    return None
