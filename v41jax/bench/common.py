"""Shared benchmark plumbing: plain wall-clock timing, a text table, a JSON file.

Benchmarks report medians of repeated, synchronised (`block_until_ready`) calls after warm-up
(compile) calls, and quote ratios of quantities measured side by side in the same process.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import jax


def time_call(fn: Callable[[], object], *, warmup: int = 2, iters: int = 5) -> dict[str, float]:
    """Median / min seconds of `fn()` (its result is blocked on) over `iters` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters}


def time_interleaved(
    calls: dict[Hashable, Callable[[], object]], *, passes: int
) -> dict[Hashable, list[float]]:
    """Seconds of each `calls[k]()` (its result blocked on) in each of `passes` passes, the
    calls taken in turn within a pass: variants compared pass by pass ran side by side, so a
    ratio between them survives the machine's drift (which `time_call`'s back-to-back runs
    of one variant do not). Compile (call once) before timing."""
    times: dict[Hashable, list[float]] = {k: [] for k in calls}
    for _ in range(passes):
        for k, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - start)
    return times


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event


class CompileCounter:
    """Counts XLA compilations (jax.monitoring's backend-compile events) inside a `with`
    block: a timed region that compiled timed the compiler too."""

    def __enter__(self) -> CompileCounter:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE:
            self.count += 1

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def machine_info() -> dict[str, object]:
    import os

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, else an error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
