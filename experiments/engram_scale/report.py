"""Tables and plots of the Engram-at-scale experiment from its summary.json (no runs needed).

python experiments/engram_scale/report.py [--summary results/summary.json]
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


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}" if x else "0"


def render_tables(data: dict) -> str:
    """The markdown table of summary.json ({"setting", "cells": [...]}): one row per cell,
    the step time also relative to the same (optimizer, placement) at its smallest table,
    and host/file decode tokens/s relative to the device cell of the same size and optimizer
    (where one ran)."""
    summary, setting = data["cells"], data["setting"]
    head = (f"Setting `{setting}`: `tiny` backbone (4 layers, d 64), one Engram layer of 8 tables "
            f"x 16-wide rows, batch 8 x 64, {summary[0]['steps']} steps.\n\n")  # fmt: skip
    cols = [
        "table params",
        "optimizer",
        "placement",
        "step ms",
        "step vs 1st size",
        "val loss",
        "device GB",
        "host GB",
        "disk GB",
        "decode tok/s b1",
        "decode tok/s b8",
        "decode vs device b1 / b8",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    first = {}
    device = {(e["table_params"], e["optimizer"]): e for e in summary if e["placement"] == "device"}
    for e in summary:
        d = device.get((e["table_params"], e["optimizer"]))
        vs = "" if d is None or d is e else (
            f"{e['decode_tok_s_b1'] / d['decode_tok_s_b1']:.2f}x / "
            f"{e['decode_tok_s_b8'] / d['decode_tok_s_b8']:.2f}x"
        )  # fmt: skip
        key = (e["optimizer"], e["placement"])
        first.setdefault(key, e["step_ms"])
        lines.append("| " + " | ".join([
            f"{e['table_params']:.0e}", e["optimizer"], e["placement"], f"{e['step_ms']:.1f}",
            f"{e['step_ms'] / first[key]:.2f}x", f"{e['val_loss']:.4f}",
            _gb(e["device_bytes"]), _gb(e["host_bytes"]), _gb(e["disk_bytes"]),
            f"{e['decode_tok_s_b1']:.0f}", f"{e['decode_tok_s_b8']:.0f}", vs,
        ]) + " |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


def plots(summary: list[dict], out_dir: str) -> None:
    groups: dict = {}
    for e in summary:
        groups.setdefault((e["optimizer"], e["placement"]), []).append(e)
    figures = [
        ("step_time", "step_ms", "train step (ms)"),
        ("val_loss", "val_loss", "val loss at equal steps"),
        ("decode", "decode_tok_s_b8", "decode tokens/s (batch 8)"),
    ]
    for name, key, ylabel in figures:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for (opt, place), es in sorted(groups.items()):
            style = {"device": "-o", "host": "--s", "file": ":^"}[place]
            ax.plot([e["table_params"] for e in es], [e[key] for e in es], style,
                    label=f"{opt} / {place}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("Engram table parameters")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--summary", default=os.path.join(HERE, "results", "summary.json"))
    args = p.parse_args(argv)
    with open(args.summary) as f:
        data = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(args.summary))
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(render_tables(data))
    plots(data["cells"], out_dir)
    print(render_tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
