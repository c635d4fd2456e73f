"""Tables and plots of the Engram table-optimizer study from its summary.json (no runs needed).

python experiments/engram_optim/report.py [--summary results/summary.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = (
    "adam",
    "adam_5x",
    "sparse_adam",
    "rowwise_adagrad",
    "sinkhorn",
    "sinkhorn_sparse",
    "recipe_v41",
)
ROW_SPARSE = ("sparse_adam", "rowwise_adagrad", "sinkhorn_sparse")
DENSE_ADAM = ("adam", "adam_5x")
TARGET_NATS = 0.02


def arm_of(row: dict) -> str:
    return row["optimizer"] if row["recipe"] == "adamw" else f"recipe_{row['recipe']}"


def best_rows(runs: list[dict]) -> dict:
    """{(table params, arm): {"lr", "seeds", "val", "val_spread", "rare", ...}} at each arm's
    best lr: the lr with the lowest seed-0 val loss among the lrs whose seed-0 run exists;
    every seed run at that lr is averaged."""
    seed0 = min((r["seed"] for r in runs), default=0)
    out = {}
    keys = sorted(
        {(r["table_params"], arm_of(r)) for r in runs}, key=lambda k: (k[0], ARMS.index(k[1]))
    )
    for size, arm in keys:
        mine = [r for r in runs if r["table_params"] == size and arm_of(r) == arm]
        firsts = [r for r in mine if r["seed"] == seed0]
        if not firsts:
            continue
        lr = min(firsts, key=lambda r: r["val_loss"])["lr"]
        at = [r for r in mine if r["lr"] == lr]
        vals = [r["val_loss"] for r in at]
        out[(size, arm)] = {
            "lr": lr,
            "lrs_tried": sorted(r["lr"] for r in firsts),
            "seeds": sorted(r["seed"] for r in at),
            "val": float(np.mean(vals)),
            "val_spread": float(np.max(vals) - np.min(vals)),
            "rare": float(np.mean([r["rare_loss"] for r in at])),
            "state_bytes": at[0]["state_bytes"],
            "table_state_bytes": at[0]["table_state_bytes"],
            "step_ms": float(np.median([r["step_ms"] for r in at])),
        }
    return out


def read_timing(out_dir: str) -> dict | None:
    """results/timing.json (`run.py --time`) when it exists."""
    path = os.path.join(out_dir, "timing.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def cost_table(timing: dict) -> list[str]:
    """The markdown lines of timing.json: each arm's train step, side by side, and state."""
    where = timing["machine"]
    lines = [
        f"Cost per step, side by side (`run.py --time`: every arm's step built at once, "
        f"{timing['rows'][0]['passes']} passes taken in turn, median; commit "
        f"{timing['commit']}, {where['processor']} x {where['cpu_count']} cores):",
        "",
    ]
    cols = ["table params", "arm", "step ms", "step vs adam_5x", "opt state MB", "table state MB"]
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for t in timing["rows"]:
        vs = f"{t['vs_adam_5x']:.2f}x" if t["vs_adam_5x"] else ""
        lines.append("| " + " | ".join([
            f"{t['table_params']:.0e}", t["arm"], f"{t['step_ms']:.0f}", vs,
            _mb(t["state_bytes"]), _mb(t["table_state_bytes"]),
        ]) + " |")  # fmt: skip
    return [*lines, ""]


def render_tables(summary: dict, timing: dict | None = None) -> str:
    """The markdown of summary.json: the lr sweep at seed 0, then each arm at its best lr
    (mean over seeds), its gap to the best dense AdamW at the same table size, state bytes
    and step time relative to dense AdamW at 5x, and the target verdict per table size.
    Step times: timing.json's side-by-side medians when given (`run.py --time`), else the
    runs' own medians (said in the text)."""
    runs, grid = summary["runs"], summary["grid"]
    lrs_text = ", ".join(f"{x:g}" for x in grid["lrs"])
    seeds_text = ", ".join(map(str, grid["seeds"]))
    where = summary["machine"]
    lines = [
        f"Setting `{summary['setting']}` (`{grid['base']}` backbone, Engram at layers "
        f"{', '.join(map(str, grid['layers']))}, {grid['steps']} steps, lrs {lrs_text}, "
        f"seeds {seeds_text}); {len(runs)} runs measured, {len(summary['pending'])} pending; "
        f"commit {summary['commit']}, {where['processor']} x {where['cpu_count']} cores.",
        "",
    ]
    if timing:
        lines += cost_table(timing)
    if not runs:
        return "\n".join(lines) + "\n"
    lrs = grid["lrs"]
    seed0 = min(r["seed"] for r in runs)
    cols = ["table params", "arm", *(f"val @ lr {x:g}" for x in lrs), "best lr"]
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    best = best_rows(runs)
    for (size, arm), b in best.items():
        cells = []
        for lr in lrs:
            hit = [r for r in runs if r["table_params"] == size and arm_of(r) == arm
                   and r["lr"] == lr and r["seed"] == seed0]  # fmt: skip
            cells.append(f"{hit[0]['val_loss']:.4f}" if hit else "")
        lines.append("| " + " | ".join([f"{size:.0e}", arm, *cells, f"{b['lr']:g}"]) + " |")
    timed = {(t["table_params"], t["arm"]): t for t in (timing or {}).get("rows", [])}
    source = (
        f"side by side, `run.py --time`, {timing['machine']['processor']}, commit "
        f"{timing['commit']}"
        if timed
        else "the runs' own medians, over hours of training on a shared machine"
    )
    lines += ["", f"At each arm's best lr (mean over the seeds run there); step ms: {source}:", ""]
    cols = ["table params", "arm", "lr", "seeds", "val loss", "spread", "vs dense AdamW"]
    cols += ["rare-bigram loss", "opt state MB", "table state MB", "step ms", "step vs adam_5x"]
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    verdicts = []
    for size in sorted({k[0] for k in best}):
        dense = [best[(size, a)] for a in DENSE_ADAM if (size, a) in best]
        ref = min(dense, key=lambda b: b["val"]) if dense else None
        base = best.get((size, "adam_5x"))
        for arm in ARMS:
            b = best.get((size, arm))
            if b is None:
                continue
            gap = f"{b['val'] - ref['val']:+.4f}" if ref else ""
            step = f"{b['step_ms'] / base['step_ms']:.2f}x" if base else ""
            if (size, arm) in timed:
                t = timed[(size, arm)]
                b = {**b, "step_ms": t["step_ms"]}
                step = f"{t['vs_adam_5x']:.2f}x" if t["vs_adam_5x"] else ""
            lines.append("| " + " | ".join([
                f"{size:.0e}", arm, f"{b['lr']:g}", ",".join(map(str, b["seeds"])),
                f"{b['val']:.4f}", f"{b['val_spread']:.4f}", gap, f"{b['rare']:.4f}",
                _mb(b["state_bytes"]), _mb(b["table_state_bytes"]), f"{b['step_ms']:.0f}", step,
            ]) + " |")  # fmt: skip
        sparse = [(a, best[(size, a)]) for a in ROW_SPARSE if (size, a) in best]
        if ref and sparse:
            name, b = min(sparse, key=lambda x: x[1]["val"])
            gap = b["val"] - ref["val"]
            ok = "meets" if gap <= TARGET_NATS else "misses"
            verdicts.append(
                f"- {size:.0e} table params: the best row-sparse optimizer, `{name}`, is "
                f"{gap:+.4f} nats from dense AdamW ({ok} the {TARGET_NATS} target)."
            )
    return "\n".join(lines + ["", *verdicts]) + "\n"


def plots(summary: dict, out_dir: str) -> None:
    runs = summary["runs"]
    sizes = sorted({r["table_params"] for r in runs})
    if not sizes:
        return
    seed0 = min(r["seed"] for r in runs)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for arm in ARMS:
            pts = sorted((r["lr"], r["val_loss"]) for r in runs if r["table_params"] == size
                         and arm_of(r) == arm and r["seed"] == seed0)  # fmt: skip
            if pts:
                style = "--o" if arm in ROW_SPARSE else "-s"
                ax.plot(*zip(*pts, strict=True), style, label=arm)
        ax.set_xscale("log")
        ax.set_xlabel("base learning rate")
        ax.set_ylabel("val loss (seed 0)")
        ax.set_title(f"{size:.0e} table params")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "val_loss_vs_lr.png"), dpi=120)
    plt.close(fig)
    best = best_rows(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        arms = [a for a in ARMS if (size, a) in best]
        x = np.array([ARMS.index(a) for a in arms]) + i * width
        axes[0].bar(x, [best[(size, a)]["val"] for a in arms], width, label=f"{size:.0e}")
        axes[1].bar(x, [best[(size, a)]["step_ms"] for a in arms], width, label=f"{size:.0e}")
    for ax, ylabel in zip(axes, ("val loss at the best lr", "step ms"), strict=True):
        ax.set_xticks(np.arange(len(ARMS)) + width * (len(sizes) - 1) / 2)
        ax.set_xticklabels(ARMS, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, title="table params")
        ax.grid(alpha=0.3, axis="y")
    vals = [b["val"] for b in best.values()]
    axes[0].set_ylim(min(vals) - 0.1, max(vals) + 0.05)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "best.png"), dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--summary", default=os.path.join(HERE, "results", "summary.json"))
    args = p.parse_args(argv)
    with open(args.summary) as f:
        summary = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(args.summary))
    tables = render_tables(summary, read_timing(out_dir))
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(tables)
    plots(summary, out_dir)
    print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
