"""Tables, plots and the issue's target checks from the deep-target DSpark summary.json.

python experiments/dspark_deep/report.py [results_dir]                (tables.md and PNGs)
python experiments/dspark_deep/report.py [results_dir] --tables-only  (tables.md only)

`render_tables(summary)` is the whole of tables.md, a pure function of summary.json: the
README quotes its tables verbatim (`tests/test_readme_figures.py` checks both).
"""

from __future__ import annotations

import json
import os
import sys

from v41jax.dspark.analysis import round_logs as A


def _row(rows, **match):
    got = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return got[0] if got else None


def target_checks(summary: dict) -> list[dict]:
    """The issue's wall-clock targets, each with the measured number and a verdict."""
    rows, checks = summary["wall_clock"], []
    for batch, temp, want in ((1, 1.0, 1.7), (4, 1.0, 1.8), (4, 0.0, 2.0)):
        best = max(
            (r for r in rows if r["batch"] == batch and r["temperature"] == temp
             and r["decoder"].startswith("dspark")),
            key=lambda r: r["speedup_vs_plain"], default=None,
        )  # fmt: skip
        if best:
            checks.append({
                "target": f"DSpark >= {want}x plain at batch {batch}, T={temp:g}",
                "measured": f"{best['decoder']}: {best['speedup_vs_plain']:.2f}x fastest, "
                f"{best['speedup_vs_plain_median']:.2f}x median",
                "met": best["speedup_vs_plain"] >= want,
            })  # fmt: skip
    sched = [r for r in rows if r["decoder"] == "dspark scheduled"]
    if sched:
        worst = min(sched, key=lambda r: r["speedup_vs_plain"])
        checks.append({
            "target": "scheduled DSpark never > 3% slower than plain (every batch, T)",
            "measured": f"worst {worst['speedup_vs_plain']:.3f}x at batch {worst['batch']}, "
            f"T={worst['temperature']:g}",
            "met": worst["speedup_vs_plain"] >= 0.97,
        })  # fmt: skip
    for b, st in summary.get("scheduler_study", {}).items():
        cfg = st["configs"]
        fixed = {n: v["tokens_per_s"] for n, v in cfg.items() if n.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        s = cfg["scheduled"]["tokens_per_s"]
        checks.append({
            "target": f"scheduler beats the best fixed length at batch {b}",
            "measured": f"{s:.1f} vs {best} {fixed[best]:.1f} tokens/s "
            f"({s / fixed[best]:.3f}x); oracle bound {st['replay']['oracle']:.3g} "
            f"vs scheduled {st['replay']['scheduled']['width']:.3g} tokens per cost-second",
            "met": s > fixed[best],
        })  # fmt: skip
    return checks


def wall_clock_table(rows: list[dict]) -> str:
    """tokens/s (speedup vs plain, fastest passes) per decoder and batch, per temperature."""
    batches = sorted({r["batch"] for r in rows})
    out = []
    for temp in sorted({r["temperature"] for r in rows}, reverse=True):
        table = []
        for dec in dict.fromkeys(r["decoder"] for r in rows):
            line = {"decoder": dec}
            for b in batches:
                r = _row(rows, decoder=dec, batch=b, temperature=temp)
                line[str(b)] = (
                    None if r is None
                    else f"{r['tokens_per_s']:.1f} ({r['speedup_vs_plain']:.2f}x)"
                )  # fmt: skip
            table.append(line)
        cols = [("decoder", f"T = {temp:g}", "")] + [(str(b), f"batch {b}", "") for b in batches]
        out.append(A.markdown_table(table, cols))
    return "\n\n".join(out)


def spread_table(rows: list[dict]) -> str:
    """How far the timed passes spread: slowest over fastest pass, per decoder and batch."""
    batches = sorted({r["batch"] for r in rows})
    out = []
    for temp in sorted({r["temperature"] for r in rows}, reverse=True):
        table = []
        for dec in dict.fromkeys(r["decoder"] for r in rows):
            line = {"decoder": dec}
            for b in batches:
                r = _row(rows, decoder=dec, batch=b, temperature=temp)
                p = (r or {}).get("passes_s")
                line[str(b)] = f"{max(p) / min(p):.2f}" if p else None
            table.append(line)
        cols = [("decoder", f"T = {temp:g}", "")] + [(str(b), f"batch {b}", "") for b in batches]
        out.append(A.markdown_table(table, cols))
    return "\n\n".join(out)


def cost_table(summary: dict) -> str:
    """c, v(L) and the ceiling tau(L) / (c + v(L)) per drafter and batch (plain rounds)."""
    rows, k_max = [], 1
    for name, by_b in summary["cost_units"].items():
        for b, u in by_b.items():
            k_max = max(k_max, len(u["v"]))
            row = {"drafter": name, "batch": int(b), "c": u["c"]}
            row["plain_ms"] = 1e3 * u["plain_round_s"] if "plain_round_s" in u else None
            row |= {f"v{j + 1}": v for j, v in enumerate(u["v"])}
            row |= {f"x{j + 1}": x for j, x in enumerate(u.get("ceiling", []))}
            rows.append(row)
    cols = [("drafter", "drafter", ""), ("batch", "batch", "d")]
    cols += [("plain_ms", "plain round (ms)", ".1f"), ("c", "c", ".3f")]
    cols += [(f"v{j}", f"v({j})", ".2f") for j in range(1, k_max + 1)]
    cols += [(f"x{j}", f"ceiling L={j}", ".2f") for j in range(1, k_max + 1)]
    return A.markdown_table(sorted(rows, key=lambda r: (r["batch"], r["drafter"])), cols)


def acceptance_table(stats: dict) -> str:
    k_max = max(len(s["acceptance"]) for s in stats.values())
    rows = []
    for name, s in stats.items():
        cal = s.get("calibration") or {}  # absent or empty when no round was calibrated
        row = {"drafter": name, "tpr": s["tokens_per_round"],
               "model": s["predicted_tokens_per_round"], "ece": cal.get("ece"),
               "len_ece": (cal.get("length") or {}).get("ece_tokens")}  # fmt: skip
        row |= {f"a{j + 1}": a for j, a in enumerate(s["acceptance"])}
        rows.append(row)
    cols = [("drafter", "drafter (batch 32, T = 1, fixed K)", "")]
    cols += [(f"a{j}", f"acc {j}", ".3f") for j in range(1, k_max + 1)]
    cols += [("tpr", "tokens/round", ".3f"), ("model", "model", ".3f"),
             ("ece", "conf ECE", ".3f"), ("len_ece", "length ECE (tok)", ".3f")]  # fmt: skip
    return A.markdown_table(rows, cols)


def scheduler_tables(summary: dict) -> str:
    out = []
    for b, st in summary.get("scheduler_study", {}).items():
        rows = [{"config": n, **v} for n, v in st["configs"].items()]
        out.append(A.markdown_table(rows, [
            ("config", f"batch {b}", ""), ("tokens_per_s", "tokens/s (fastest)", ".1f"),
            ("tokens_per_s_median", "tokens/s (median)", ".1f"),
            ("mean_verify_len", "mean L", ".2f"),
        ]))  # fmt: skip
        rp = st["replay"]
        fixed = ", ".join(f"L={j + 1}: {x:.3g}" for j, x in enumerate(rp["fixed"]))
        plain = "-" if rp.get("plain") is None else f"{rp['plain']:.3g}"
        out.append(
            f"Replay at batch {b} (tokens per cost-second on the same {rp['rounds']} rounds): "
            f"plain {plain}; fixed {fixed}; scheduled {rp['scheduled']['width']:.3g} "
            f"(mean width {rp['scheduled_widths']['width']:.2f}); oracle bound "
            f"{rp['oracle']:.3g} (mean width {rp['oracle_widths']:.2f})."
        )
    return "\n\n".join(out)


def render_tables(summary: dict) -> str:
    checks = target_checks(summary)
    parts = [
        "## Targets",
        A.markdown_table(
            checks, [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")]
        ),  # fmt: skip
        "## Wall clock (tokens/s, speedup vs plain decoding in the same passes)",
        wall_clock_table(summary["wall_clock"]),
        "## Spread of the timed passes (slowest pass / fastest pass)",
        spread_table(summary["wall_clock"]),
        "## Round costs in plain decode rounds",
        cost_table(summary),
        "## Acceptance, tokens per round, calibration",
        acceptance_table(summary["stats"]),
        "## The scheduler against plain decoding and every fixed length",
        scheduler_tables(summary),
    ]
    return "\n\n".join(parts) + "\n"


def write_report(summary: dict, out_dir: str, *, plots: bool = True) -> str:
    """Write tables.md (`render_tables`) and the PNGs into out_dir; return the markdown."""
    text = render_tables(summary)
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(text)
    if not plots:
        return text
    stats, rows = summary["stats"], summary["wall_clock"]
    A.plot_acceptance(
        {n: v["acceptance"] for n, v in stats.items()}, os.path.join(out_dir, "acceptance.png")
    )
    A.plot_reliability(
        {n: v["calibration"] for n, v in stats.items() if n.startswith("dspark")},
        os.path.join(out_dir, "reliability.png"),
    )
    for temp, tag in ((1.0, "t1"), (0.0, "greedy")):
        A.plot_throughput(
            [
                {"name": r["decoder"], "batch": r["batch"], "tokens_per_s": r["tokens_per_s"]}
                for r in rows
                if r["temperature"] == temp
            ],  # fmt: skip
            os.path.join(out_dir, f"throughput_{tag}.png"),
        )
    return text


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--tables-only"]
    out = args[0] if args else os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(out, "summary.json")) as f:
        print(write_report(json.load(f), out, plots="--tables-only" not in sys.argv))
