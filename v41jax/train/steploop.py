"""The one step loop both trainers run: `train` (`v41jax.train.loop`) and `train-drafter`
(`v41jax.dspark.train.loop`, one or several drafters against a frozen target).

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
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from v41jax.train.checkpoint import StopSignal
from v41jax.train.metrics import MetricsWriter, ResumedLog
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
        """From a config with these four fields (`TrainConfig`: a run's `train`, a drafter's
        `train.loop`)."""
        t = train_cfg
        return cls(t.steps, t.log_every, t.eval_every, t.checkpoint_every)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def evaluates(self, step: int) -> bool:
        return step == self.steps or bool(self.eval_every and step % self.eval_every == 0)

    def saves(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.steps


def step_ranges(steps: Iterable[int]) -> str:
    """[21, 22, 23, 24, 30] -> "21-24, 30"."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _steps(steps: Iterable[int]) -> str:
    """Like "step 24" or "steps 21-24"."""
    steps = set(steps)
    return f"step{'' if len(steps) == 1 else 's'} {step_ranges(steps)}"


def log_gaps(found: ResumedLog, logs: Callable[[int], bool] | None) -> tuple[list[str], list[int]]:
    """(what to say, the steps with no train line) about a log resumed at `found.start`.

    A step lacks its train line when the log's last intact train line is before it, it is
    not after the checkpoint (so it is not trained again), and the run logs it (`logs`: the
    cadence it ran under; None: only the steps a cut line names). Lines moved aside for steps
    after the checkpoint are not lost: the resumed run writes them again."""
    name, start, have = "metrics.jsonl", found.start, set(found.train_steps)
    cut_steps = found.cut_steps()
    missing = {s for s in cut_steps if s <= start and s not in have}
    if logs is not None:
        missing |= {s for s in range(max(have, default=0) + 1, start + 1) if logs(s)}
    notes = []
    if not found.existed:
        notes.append(f"warning: {name} was missing; a new one starts after step {start}")
    if found.cut:
        which = ", ".join(f"step {s}" for s in cut_steps) or "its step unreadable"
        what = "its last line was" if len(found.cut) == 1 else f"{len(found.cut)} lines were"
        notes.append(
            f"warning: {name}: {what} cut short (a kill mid-write; {which}), kept in {found.aside}"
        )
    if found.later:
        notes.append(
            f"{name}: the lines of {_steps(found.later)} are moved to "
            f"{found.aside}: the run resumes from checkpoint {start} and trains those "
            "steps again"
        )
    if missing:
        notes.append(
            f"warning: {name}: {_steps(missing)} {'has' if len(missing) == 1 else 'have'} no "
            f"train line: trained before checkpoint {start}, they are not trained again"
        )
    return notes, sorted(missing)


class RunLog:
    """A run's records, to WORKDIR/metrics.jsonl and WORKDIR/tensorboard together; later
    lines a killed run left after `start` are set aside (`MetricsWriter`, `TensorBoard`).
    Only the writing process (`enabled`) writes.

    On a resume it says on stderr what the log lost or set aside (`log_gaps`; `cadence`:
    the one the trained steps ran under, to find steps whose train line is missing), and a
    log that lost lines gets a record saying so at `start`: {"step", "log_note",
    "missing_train_steps"} (no "loss": readers of train lines skip it)."""

    def __init__(
        self,
        workdir: Any,
        start: int,
        *,
        enabled: bool,
        tensorboard: bool = True,
        cadence: Cadence | None = None,
    ):
        workdir = as_path(workdir)  # a local path or a gs:// URL alike
        self.metrics = MetricsWriter(workdir / "metrics.jsonl", start, enabled)
        self.board = TensorBoard(workdir / "tensorboard", start, enabled and tensorboard)
        if (found := self.metrics.resumed) is not None:
            notes, missing = log_gaps(found, cadence.logs if cadence else None)
            for note in notes:
                print(note, file=sys.stderr)
            if missing or found.cut or not found.existed:
                note = "; ".join(n.removeprefix("warning: ") for n in notes)
                self.metrics.write(
                    {"step": start, "log_note": note, "missing_train_steps": missing}
                )

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
