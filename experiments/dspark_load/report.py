"""Tables and plots of the DSpark load study, from summary.json alone.

python experiments/dspark_load/report.py [--summary results/summary.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXED = [f"fixed_L{k}" for k in range(1, 9)]


def _by(rows: list[dict]) -> dict:
    return {(r["decoder"], r["concurrency"]): r for r in rows}


def targets(summary: dict) -> list[dict]:
    """The issue's targets, each {"target", "measured", "met"}."""
    rows, load = _by(summary["load"]), summary["load"]
    levels = sorted({r["concurrency"] for r in load})
    top, out = levels[-1], []
    ragged = [rows[("scheduled_ragged", c)] for c in levels if ("scheduled_ragged", c) in rows]
    if ragged:
        worst = min(ragged, key=lambda r: r["speedup_vs_plain"])
        s, c = worst["speedup_vs_plain"], worst["concurrency"]
        out.append({
            "target": "ragged scheduler never slower than plain (>= 0.97x at every load)",
            "measured": f"worst {s:.3f}x at concurrency {c}",
            "met": s >= 0.97,
        })  # fmt: skip
    if ("scheduled_ragged", 1) in rows:
        s = rows[("scheduled_ragged", 1)]["speedup_vs_plain"]
        out.append({"target": "ragged scheduler >= 1.7x plain at concurrency 1",
                    "measured": f"{s:.3f}x", "met": s >= 1.7})  # fmt: skip
    fixed = [rows[(f, top)] for f in FIXED if (f, top) in rows]
    if fixed and ("scheduled_ragged", top) in rows:
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        ratio = rows[("scheduled_ragged", top)]["tokens_per_s"] / best["tokens_per_s"]
        out.append({
            "target": f"ragged scheduler >= 1.05x the best fixed length at concurrency {top}",
            "measured": f"{ratio:.3f}x {best['decoder']}",
            "met": ratio >= 1.05,
        })  # fmt: skip
    return out


def findings(summary: dict) -> list[str]:
    """Where fixed L = K falls below plain, and where the ragged scheduler turns speculation
    (nearly) off, read from the load rows."""
    rows = _by(summary["load"])
    levels = sorted({r["concurrency"] for r in summary["load"]})
    k = summary["drafter"]["block_size"]
    out = []
    below = [c for c in levels if (f"fixed_L{k}", c) in rows
             and rows[(f"fixed_L{k}", c)]["speedup_vs_plain"] < 1.0]  # fmt: skip
    out.append(
        f"fixed L = {k} falls below plain at concurrency {', '.join(map(str, below))}"
        if below
        else f"fixed L = {k} stays above plain at every concurrency measured"
    )
    for c in levels:
        r = rows.get(("scheduled_ragged", c))
        if r is not None:
            out.append(f"concurrency {c}: the ragged scheduler verifies {r['mean_verify_len']:.2f} "
                       f"drafts per round on average (0 = speculation off)")  # fmt: skip
    return out


def loop_efficiency(summary: dict) -> list[dict]:
    """How close continuous batching runs to the round-cost table, per fixed decoder (plain,
    fixed L) and concurrency c: the table's rate c (1 + a L) / seconds(L) (a: the run's
    acceptance, so 1 + a L tokens per row and round; L = 0 for plain) against the measured
    tokens/s. The table times decode rounds only; the gap is what serving adds: each
    request's prefill (its whole prompt through the target, which speculation does not
    speed up), the drafter pass of every refill, a segment end per finish, and rows
    finishing mid-round. Each row {"decoder", "concurrency", "table_tokens_per_s", "efficiency"}."""
    out = []
    for r in summary["load"]:
        name, c = r["decoder"], r["concurrency"]
        if name != "plain" and name not in FIXED:
            continue
        width = 0 if name == "plain" else int(name.removeprefix("fixed_L"))
        padded = summary["costs"][str(c)]["padded"]
        seconds = dict(zip(padded["tokens"], padded["seconds"], strict=True)).get(c * (1 + width))
        if seconds is None:  # a table without that width
            continue
        ideal = c * (1 + r["acceptance"] * width) / seconds
        out.append({"decoder": name, "concurrency": c, "table_tokens_per_s": ideal,
                    "efficiency": r["tokens_per_s"] / ideal})  # fmt: skip
    return out


def _table(header: list[str], body: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in body]


def render_tables(summary: dict) -> str:
    """tables.md: a function of summary.json alone."""
    load, rows = summary["load"], _by(summary["load"])
    levels = sorted({r["concurrency"] for r in load})
    names = list(dict.fromkeys(r["decoder"] for r in load))
    m = summary["machine"]
    out = [
        "# DSpark under load",
        "",
        f"Machine: {m.get('cpu', m)}; commit {summary['commit']}; setting {summary['setting']}.",
        "",
    ]
    if summary.get("missing_groups"):
        out += [
            "**Partial** (`run.py --finished-only`): not measured yet: "
            + ", ".join(summary["missing_groups"]) + ". The targets read the groups measured.",
            "",
        ]  # fmt: skip
    out += [
        "## Targets",
        "",
    ]
    out += _table(["target", "measured", "met"],
                  [[t["target"], t["measured"], t["met"]] for t in targets(summary)])  # fmt: skip
    out += ["", *[f"- {x}" for x in findings(summary)]]
    out += ["", "## Output tokens/s (speedup vs plain), closed loop, fastest pass", ""]
    body = []
    for n in names:
        cells = []
        for c in levels:
            r = rows.get((n, c))
            cells.append(
                "" if r is None else f"{r['tokens_per_s']:.1f} ({r['speedup_vs_plain']:.2f}x)"
            )
        body.append([n, *cells])
    out += _table(["decoder", *[f"c = {c}" for c in levels]], body)
    out += ["", "## Per-request latency p50 / p99 (s)", ""]
    body = [[n, *[("" if (r := rows.get((n, c))) is None else
                   f"{r['p50_latency_s']:.2f} / {r['p99_latency_s']:.2f}") for c in levels]]
            for n in names]  # fmt: skip
    out += _table(["decoder", *[f"c = {c}" for c in levels]], body)
    out += ["", "## Mean verify length (drafts verified per round)", ""]
    body = [[n, *[("" if (r := rows.get((n, c))) is None else f"{r['mean_verify_len']:.2f}")
                  for c in levels]] for n in names if n != "plain"]  # fmt: skip
    out += _table(["decoder", *[f"c = {c}" for c in levels]], body)
    out += ["", "## What a verify costs at each concurrency (measured round-cost tables)", ""]
    body = []
    for c in levels:
        padded = summary["costs"][str(c)]["padded"]
        plain, full = padded["seconds"][0], padded["seconds"][-1]
        ragged = summary["costs"][str(c)]["ragged"]["rounds"]
        per_token = ragged["seconds"][-1] / ragged["tokens"][-1]
        body.append([c, f"{1e3 * plain:.1f}", f"{1e3 * full:.1f}", f"{full / plain:.2f}",
                     f"{1e3 * ragged['seconds'][0]:.1f} ({ragged['tokens'][0]})",
                     f"{1e3 * per_token:.2f}"])  # fmt: skip
    k = summary["drafter"]["block_size"]
    out += _table(["concurrency", "plain round (ms)", f"round verifying K = {k} (ms)",
                   "ratio", "ragged round at its smallest size (ms; packed tokens): the "
                   "drafter's pass over every row and one row's verify",
                   "ragged ms per packed token (largest size)"], body)  # fmt: skip
    out += [
        "",
        "## Measured / the cost table's decode-only rate (prefill and refills are the rest)",
        "",
    ]
    eff = {(e["decoder"], e["concurrency"]): e for e in loop_efficiency(summary)}
    body = [[n, *[("" if (e := eff.get((n, c))) is None else
                   f"{e['efficiency']:.2f} (of {e['table_tokens_per_s']:.0f})") for c in levels]]
            for n in names if n == "plain" or n in FIXED]  # fmt: skip
    out += _table(["decoder", *[f"c = {c}" for c in levels]], body)
    if summary.get("open_loop"):
        out += ["", "## Open loop (Poisson arrivals)", ""]
        body = [[r["decoder"], f"{r['rate_fraction']:.2f}", f"{r['rate_per_s']:.2f}",
                 f"{r['tokens_per_s']:.1f}", f"{r['p50_latency_s']:.2f}",
                 f"{r['p99_latency_s']:.2f}", f"{r['mean_verify_len']:.2f}"]
                for r in summary["open_loop"]]  # fmt: skip
        out += _table(["decoder", "rate (x plain capacity)", "requests/s", "tokens/s",
                       "p50 latency (s)", "p99 latency (s)", "mean verify len"], body)  # fmt: skip
    return "\n".join(out) + "\n"


def plot(summary: dict, out_dir: str) -> list[str]:
    load = summary["load"]
    levels = sorted({r["concurrency"] for r in load})
    rows, names = _by(load), list(dict.fromkeys(r["decoder"] for r in load))
    paths = []
    for key, ylabel, name in (("tokens_per_s", "output tokens/s", "throughput.png"),
                              ("speedup_vs_plain", "speedup vs plain", "speedup.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n in names:
            xs = [c for c in levels if (n, c) in rows]
            style = "-" if n.startswith("scheduled") or n == "plain" else ":"
            ax.plot(xs, [rows[(n, c)][key] for c in xs], style, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(summary: dict, out_dir: str) -> str:
    text = render_tables(summary)
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(text)
    plot(summary, out_dir)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", default=os.path.join(HERE, "results", "summary.json"))
    args = p.parse_args(argv)
    with open(args.summary) as f:
        summary = json.load(f)
    print(write_report(summary, os.path.dirname(os.path.abspath(args.summary))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
