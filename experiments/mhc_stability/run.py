"""Regenerate the mHC stability experiment: train every (arm, seed), then tables and plots.

    python experiments/mhc_stability/run.py [--runs-dir runs/mhc_stability]

Runs are resumable (each is a v41jax workdir; a finished one is only re-evaluated). Writes
`results/summary.json`, `results/loss.png` and `results/gain.png` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module  # noqa: E402

_config = experiment_module(HERE, "config")
ARMS, SEEDS, get_config = _config.ARMS, _config.SEEDS, _config.get_config

from v41jax.train import train  # noqa: E402
from v41jax.train.metrics import read_metrics  # noqa: E402


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs-dir", default="runs/mhc_stability")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    summary = []
    for arm in ARMS:
        for seed in SEEDS:
            cfg = get_config(f"{arm},seed={seed}")
            workdir = os.path.join(args.runs_dir, f"{arm}_seed{seed}")
            result = train(cfg, workdir)
            rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
            _, loss = _series(rows, "loss")
            entry = {
                "arm": arm,
                "seed": seed,
                "workdir": workdir,
                "val_loss": result["val_loss"],
                "final_train_loss": float(loss[-1]),
                "max_train_loss_after_warmup": float(loss[10:].max()),
            }
            for key in ("mhc_forward_gain", "mhc_backward_gain"):
                _, gain = _series(rows, key)
                if gain.size:
                    entry[f"max_{key}"] = float(gain.max())
                    entry[f"final_{key}"] = float(gain[-1])
            summary.append(entry)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    colors = {"baseline": "tab:gray", "hc": "tab:red", "mhc": "tab:blue"}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for e in summary:
        steps, loss = _series(read_metrics(os.path.join(e["workdir"], "metrics.jsonl")), "loss")
        ax.plot(
            steps,
            loss,
            color=colors[e["arm"]],
            alpha=0.8,
            lw=1,
            label=e["arm"] if e["seed"] == SEEDS[0] else None,
        )
    ax.set(xlabel="step", ylabel="train loss", title="train loss (2 seeds per arm)")
    ax.set_ylim(top=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=80)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for e in summary:
        if e["arm"] == "baseline":
            continue
        rows = read_metrics(os.path.join(e["workdir"], "metrics.jsonl"))
        for key, style in (("mhc_forward_gain", "-"), ("mhc_backward_gain", ":")):
            steps, gain = _series(rows, key)
            ax.plot(
                steps,
                gain,
                style,
                color=colors[e["arm"]],
                lw=1,
                label=f"{e['arm']} {key.split('_')[1]}" if e["seed"] == SEEDS[0] else None,
            )
    ax.set(
        xlabel="step",
        ylabel="composite Amax gain (worst token)",
        yscale="log",
        title="gain of the H_res product across 16 sub-layers",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "gain.png"), dpi=80)
    for e in summary:
        print(json.dumps({k: v for k, v in e.items() if k != "workdir"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
