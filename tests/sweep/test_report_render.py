"""tables.md is a pure function of the committed results: rendering again from summary.json
(no run dirs) gives what `write_report` wrote from the runs. Fake result.json files, no
training."""

from __future__ import annotations

import json
import os

from v41jax.sweep.driver import RESULT_FILE
from v41jax.sweep.report import render_from_results, render_tables, write_report

ARMS = {  # arm: (meta, total params, FLOPs/token, val loss per seed, s/step per seed)
    "baseline": ({"kind": "baseline", "p_added": 0}, 1000, 9.0e6, (4.0, 4.2), (0.2, 0.3)),
    "engram_1k": (
        {"kind": "engram", "p_added": 500, "p_index": 0},
        1500,
        9.2e6,
        (3.5, 3.7),
        (0.2, 0.4),
    ),  # fmt: skip
    "ffn_1k": (
        {"kind": "ffn", "p_added": 500, "p_index": 0, "d_ff": 9},
        1500,
        18.0e6,
        (3.9, 4.1),
        (0.4, 0.8),
    ),  # fmt: skip
}


def _fake_runs(runs_dir: str) -> None:
    for arm, (meta, total, flops, losses, steps) in ARMS.items():
        for seed, (loss, step_s) in enumerate(zip(losses, steps, strict=True)):
            d = os.path.join(runs_dir, "quality", f"{arm}_seed{seed}")
            os.makedirs(d)
            acc = {"total_params": total, "active_params": total, "flops_per_token": flops}
            res = {"study": "quality", "arm": arm, "seed": seed, "val_loss": loss}
            res |= {"tokens_seen": 100, "wall_s": 60.0 * step_s, "step_s": step_s}
            res |= {"accounting": acc | {"engram_params": 0}, "meta": meta}
            with open(os.path.join(d, RESULT_FILE), "w") as f:
                json.dump(res, f)


def test_tables_md_renders_again_from_summary_json_alone(tmp_path):
    runs, exp = str(tmp_path / "runs"), str(tmp_path / "exp")
    _fake_runs(runs)
    written = write_report(exp, runs, echo=False)
    with open(written["tables"]) as f:
        tables = f.read()
    assert render_from_results(exp, source=runs) == tables
    assert "| baseline | baseline |" in tables and "## seconds per step by run" in tables
    # the differences table: Engram mean 3.6, FFN 4.0, baseline 4.1
    assert "| 500 | -0.4000 | -0.5000 | -0.1000 | 1.022 | 2.000 | 0.511 |" in tables
    assert "| quality | ffn_1k | 0.400 | 0.800 | 2.00 | 72 |" in tables
    assert "Wall-clock of all 6 runs (wall_s summed): 138 s = 0 h 2 min." in tables


def test_render_tables_without_study3_or_source():
    rows = [
        {"study": "s", "arm": "a", "seed": 0, "val_loss": 1.0, "step_s": 0.5, "meta": {}}
        | {"total_params": 10, "active_params": 10, "flops_per_token": 1.0, "engram_params": 0}
    ]
    md = render_tables(rows)
    assert md.startswith("# Results\n") and "| s | a | 10 | 10 | 0 | 1 | - | - |" in md
    assert "| s | a | 0.500 | 1.00 | 0 |" in md  # one seed: max / min 1, no wall_s
    assert "differences of the means" not in md
