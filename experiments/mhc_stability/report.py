"""The mHC stability experiment's table, rendered from results/summary.json alone.

python experiments/mhc_stability/report.py     (writes results/tables.md and prints it)

`run.py` writes summary.json (one row per arm and seed) and the plots; the README copies the
table below from tables.md (`tests/test_readme_figures.py` checks both).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _gain(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.0f}"


def render_tables(summary: list[dict]) -> str:
    header = ["arm", "seed", "val loss (step 300)", "max forward gain", "final forward gain"]
    header += ["max backward gain", "final backward gain"]
    rows = [
        [r["arm"], r["seed"], f"{r['val_loss']:.3f}"]
        + [
            _gain(r.get(f"{k}_mhc_{d}_gain"))
            for d in ("forward", "backward")
            for k in ("max", "final")
        ]  # fmt: skip
        for r in summary
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return (
        "# mHC stability (rendered by experiments/mhc_stability/report.py)\n\n"
        + "\n".join(lines)
        + "\n"
    )


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results")
    with open(os.path.join(out, "summary.json")) as f:
        text = render_tables(json.load(f))
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(text)
    print(text)
