"""The throughput experiment's tables, rendered from results/summary.json alone.

python experiments/spec_throughput/report.py     (writes results/tables.md and prints it)

`run.py` writes summary.json and the plots; the README copies the tables below from
tables.md (`tests/test_readme_figures.py` checks both).
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _md(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def chi2_sf_even(x: float, dof: int) -> float:
    """P(chi^2_dof >= x) for an even dof: exp(-x/2) sum_{i < dof/2} (x/2)^i / i!."""
    term, total = 1.0, 1.0
    for i in range(1, dof // 2):
        term *= (x / 2) / i
        total += term
    return math.exp(-x / 2) * total


def monte_carlo_table(mc: list[dict]) -> str:
    alphas, ks = sorted({r["alpha"] for r in mc}), sorted({r["k"] for r in mc})
    cell = {(r["alpha"], r["k"]): r for r in mc}
    rows = [
        [a]
        + [
            f"{cell[a, k]['measured']:.3f} / {cell[a, k]['model']:.3f} ({cell[a, k]['z']:+.1f})"
            for k in ks
        ]
        for a in alphas
    ]
    table = _md(["alpha", *(f"k={k}" for k in ks)], rows)
    z2 = sum(r["z"] ** 2 for r in mc)
    worst = max(mc, key=lambda r: abs(r["z"]))
    p_one = math.erfc(abs(worst["z"]) / math.sqrt(2))  # two-sided, one cell
    p_max = 1 - (1 - p_one) ** len(mc)
    dof = len(mc)
    p_z2 = chi2_sf_even(z2, dof) if dof % 2 == 0 else float("nan")
    return table + (
        f"\n\n{len(mc)} z-scores: sum of squares {z2:.1f} on {dof} degrees of freedom "
        f"(p = {p_z2:.2f}); largest |z| {abs(worst['z']):.1f} (alpha {worst['alpha']}, "
        f"k {worst['k']}), reached by the largest of {len(mc)} independent normal |z| with "
        f"probability {p_max:.2f}."
    )


def real_table(real: dict) -> str:
    rows = []
    for r in real["rows"]:
        rows.append(
            [r["temperature"], r["k"], " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])]
            + [f"{r['tokens_per_round']:.2f}", f"{r['speedup_measured']:.2f}"]
            + [f"{r['speedup_predicted']:.2f}", f"{r['lockstep_efficiency']:.2f}"]
            + [f"{r['speedup_predicted_lockstep']:.2f}", r["rounds"]]
            + [f"{1e3 * r['round_s_measured']:.1f}", f"{1e3 * r['round_s_model']:.1f}"]
        )
    header = ["T", "k", "acceptance per position", "tokens/round", "measured speedup"]
    header += ["model speedup", "lockstep eff.", "model x lockstep", "rounds"]
    table = _md([*header, "ms/round measured", "ms/round model"], rows)
    rs = real["rows"]
    gap = [r["speedup_predicted_lockstep"] - r["speedup_measured"] for r in rs]
    over = [r["round_s_measured"] / r["round_s_model"] - 1 for r in rs]
    steps = {}
    for r in rs:
        steps.setdefault(r["temperature"], (r["target_step_s"], r["drafter_step_s"]))
    costs = "; ".join(
        f"T = {t}: verify(1..{len(v)}) "
        + ", ".join(f"{1e3 * v[str(i + 1)]:.1f}" for i in range(len(v)))
        + f" ms, drafter step {1e3 * d:.2f} ms"
        for t, (v, d) in steps.items()
    )
    return table + (
        f"\n\nStep costs: {costs}. Model speedup - measured: "
        f"{min(r['speedup_predicted'] - r['speedup_measured'] for r in rs):.2f} to "
        f"{max(r['speedup_predicted'] - r['speedup_measured'] for r in rs):.2f}; "
        f"model x lockstep - measured: {min(gap):+.2f} to {max(gap):+.2f} "
        f"(|gap| <= 0.2 in {sum(abs(g) <= 0.2 for g in gap)} of {len(gap)} rows); "
        f"ms/round measured vs model: {100 * min(over):+.0f}% to {100 * max(over):+.0f}% "
        f"(mean {100 * sum(over) / len(over):+.0f}%)."
    )


def render_tables(summary: dict) -> str:
    return (
        "# Speculative throughput (rendered by experiments/spec_throughput/report.py)\n\n"
        f"## Monte Carlo\n\n{monte_carlo_table(summary['monte_carlo'])}\n\n"
        f"## Real target and drafter\n\n{real_table(summary['real'])}\n"
    )


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results")
    with open(os.path.join(out, "summary.json")) as f:
        text = render_tables(json.load(f))
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(text)
    print(text)
