"""`WORKDIR/metrics.jsonl`: one JSON object per line, each with at least `step`.

Train lines carry `loss` (the train loss of that step); eval lines carry `val_loss`. On resume
from step s, lines with step > s were written by the killed run after its last checkpoint; the
resumed run recomputes exactly those steps, so they are moved aside to
`metrics.jsonl.after_<s>` (kept, never deleted) and the main file stays one clean history.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


class MetricsWriter:
    def __init__(self, path: str, resume_step: int = 0, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        if enabled and os.path.exists(path):
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        with open(self.path) as f:
            lines = [ln for ln in f if ln.strip()]
        keep, later = [], []
        for ln in lines:
            try:
                record = json.loads(ln)
            except json.JSONDecodeError:  # a line cut by SIGKILL mid-write
                later.append(ln)
                continue
            (later if record.get("step", 0) > step else keep).append(ln)
        if later:
            with open(f"{self.path}.after_{step}", "a") as f:
                f.writelines(ln if ln.endswith("\n") else ln + "\n" for ln in later)
        with open(self.path, "w") as f:
            f.writelines(keep)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({k: _jsonable(v) for k, v in record.items()})
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]
