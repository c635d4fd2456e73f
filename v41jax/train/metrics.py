"""`WORKDIR/metrics.jsonl`: one JSON object per line, each with at least `step`.

Train lines carry `loss` (the train loss of that step); eval lines carry `val_loss`. On resume
from step s, lines with step > s were written by the killed run after its last checkpoint; the
resumed run recomputes exactly those steps, so they are moved aside to
`metrics.jsonl.after_<s>` (kept, never deleted) and the main file stays one clean history.
So are lines that do not parse (one cut short by a kill mid-write). What was found is kept
in `MetricsWriter.resumed` (`ResumedLog`) for the caller to report (`v41jax.train.steploop`).

The path may be any `etils.epath` path (a gs:// workdir): a local file is appended to line by
line as always; an object store cannot append, so there the writer keeps the file's text and
uploads it whole with each line (one object replaced at once: never a half-written line).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from typing import Any

from v41jax.train import workdir as workdir_lib


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


@dataclasses.dataclass(frozen=True)
class ResumedLog:
    """What metrics.jsonl held on resuming from checkpoint `start`."""

    start: int
    aside: str  # the side file the lines below were moved to (its name)
    later: tuple[int, ...]  # steps of whole lines past `start`: trained again, moved aside
    cut: tuple[str, ...]  # lines that do not parse (cut short by a kill), moved aside
    train_steps: tuple[int, ...]  # steps <= start whose train line ("loss") is kept
    existed: bool = True  # False: no metrics.jsonl at all

    def cut_steps(self) -> list[int]:
        """The steps the cut lines were for, where what is left of them says."""
        found = (re.match(r'\s*\{"step": (\d+)', ln) for ln in self.cut)
        return [int(m.group(1)) for m in found if m]


class MetricsWriter:
    def __init__(self, path: str | os.PathLike, resume_step: int = 0, enabled: bool = True):
        self.path = workdir_lib.as_path(path)
        self.enabled = enabled
        self._local = workdir_lib.is_local(self.path)
        self._text = ""  # an object store's file as last uploaded
        self.resumed: ResumedLog | None = None  # what an existing log held (or lacked)
        if enabled and self.path.exists():
            self._truncate_after(resume_step)
        elif enabled and resume_step:
            aside = f"{self.path.name}.after_{resume_step}"
            self.resumed = ResumedLog(resume_step, aside, (), (), (), existed=False)

    def _truncate_after(self, step: int) -> None:
        lines = [ln for ln in io.StringIO(self.path.read_text()) if ln.strip()]
        keep, later, later_steps, cut, train_steps = [], [], [], [], []
        for ln in lines:
            try:
                record = json.loads(ln)
            except json.JSONDecodeError:  # a line cut by SIGKILL mid-write
                later.append(ln)
                cut.append(ln.rstrip("\n"))
                continue
            if record.get("step", 0) > step:
                later.append(ln)
                later_steps.append(record["step"])
            else:
                keep.append(ln)
                if "loss" in record:
                    train_steps.append(record.get("step", 0))
        aside_name = f"{self.path.name}.after_{step}"
        self.resumed = ResumedLog(
            step, aside_name, tuple(sorted(set(later_steps))), tuple(cut), tuple(train_steps)
        )
        if later:
            aside = self.path.parent / aside_name
            text = "".join(ln if ln.endswith("\n") else ln + "\n" for ln in later)
            if self._local:
                with aside.open("a") as f:
                    f.write(text)
            else:
                workdir_lib.write_text_atomic(
                    aside, (aside.read_text() if aside.exists() else "") + text
                )
        self._text = "".join(keep)
        self.path.write_text(self._text)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({k: _jsonable(v) for k, v in record.items()})
        if not self._local:
            self._text += line + "\n"
            self.path.write_text(self._text)
            return
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    text = workdir_lib.as_path(path).read_text()
    return [json.loads(ln) for ln in io.StringIO(text) if ln.strip()]
