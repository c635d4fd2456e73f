"""Report of a sweep from its run directories alone: summary.json, markdown tables, plots.

Reads every `<runs_dir>/<study>/<run>/result.json` (written by the driver after each run)
and writes to `<experiment_dir>/results/`:

    summary.json  a list of runs: study, arm, seed, total_params, active_params,
                  flops_per_token, engram_params, val_loss, tokens_seen, wall_s, step_s, meta...
    tables.md     one table per study (mean val loss over seeds with [min, max]), Study 3,
                  the accounting of every arm, per-run times and (quality layout) the
                  differences between arms: `render_tables(summary, study3)`, a pure function
                  of summary.json and study3.json, so `python -m v41jax.sweep.report DIR`
                  re-renders tables.md from the committed results alone (no run dirs)
    study3.json   the Study 3 analyses the tables use
    *.png         plots (small, dpi 90)

A study's layout comes from its runs' `meta`:
- `kind` in {baseline, engram, ffn} with `p_added` (quality per parameter): val loss vs
  total params and vs FLOPs/token (log x; mean over seeds, bars min..max), seconds per step.
- `rho` (allocation): val loss vs rho, the fraction of the sparse budget in experts.
- anything else: a table per arm.
Study 3: the run with the lowest val_loss among those with the `engram_off` analysis (the
"best Engram model"); its analysis (computed now if the sweep did not), and the token-type
losses of the baseline and the matched-FFN run of the same study, seed and `p_index`.
"""

from __future__ import annotations

import glob
import json
import operator
import os

from v41jax import config as config_lib
from v41jax.sweep.analysis import load_or_run_analysis
from v41jax.sweep.driver import RESULT_FILE
from v41jax.sweep.tables import (  # noqa: F401  (ACCOUNTING_KEYS, render_*: re-exported)
    ACCOUNTING_KEYS,
    KIND_STYLE,
    group_arms,
    render_from_results,
    render_tables,
    table_layout,
)
from v41jax.train.workdir_kind import require_kind

SUMMARY_KEYS = (
    "study",
    "arm",
    "seed",
    "total_params",
    "active_params",
    "flops_per_token",
    "engram_params",
    "val_loss",
    "tokens_seen",
    "wall_s",
)


def collect_runs(runs_dir: str) -> list[dict]:
    """One summary row per `<runs_dir>/<study>/<run>/result.json`, sorted by study, arm, seed."""
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"runs dir {runs_dir!r} does not exist; run the sweep first")
    rows = []
    for path in glob.glob(os.path.join(runs_dir, "*", "*", RESULT_FILE)):
        res = config_lib.read_json(path)
        acc = res.get("accounting", {})
        row = {k: res[k] for k in ("study", "arm", "seed")}
        row |= {k: acc.get(k) for k in ACCOUNTING_KEYS}
        row |= {k: res.get(k) for k in ("val_loss", "tokens_seen", "wall_s", "step_s", "step")}
        row |= {k: v for k, v in res.items() if k.startswith(("final_", "mean_moe"))}
        row["meta"] = res.get("meta", {})
        row["eval_only_analysis"] = res.get("eval_only_analysis", [])
        row["workdir"] = os.path.dirname(path)
        row["accounting"] = acc
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no {RESULT_FILE} under {runs_dir}/<study>/<run>/")
    return sorted(rows, key=lambda r: (r["study"], r["arm"], r["seed"]))


# ----------------------------------------------------------------------------- Study 3


def study3(rows: list[dict]) -> dict | None:
    """Analyses of the best Engram run and its baseline / matched-FFN runs (module doc)."""
    flagged = [r for r in rows if "engram_off" in r["eval_only_analysis"]]
    if not flagged:
        return None
    analysed = []
    for r in flagged:
        a = load_or_run_analysis("engram_off", r["workdir"])
        analysed.append(a | {"run": f"{r['study']}/{r['arm']}_seed{r['seed']}", "row": r})
    best = min(analysed, key=lambda a: a["row"]["val_loss"])
    b = best["row"]
    compare = {}
    for r in rows:
        same = r["study"] == b["study"] and r["seed"] == b["seed"] and r is not b
        kind = r["meta"].get("kind")
        matched = kind == "ffn" and r["meta"].get("p_index") == b["meta"].get("p_index")
        if same and (kind == "baseline" or matched):
            a = load_or_run_analysis("token_split", r["workdir"])
            compare[kind] = {"arm": r["arm"], "groups": a["groups"]}
    for a in analysed:
        a["val_loss"] = a.pop("row")["val_loss"]
    return {"best": best, "compare": compare, "all_engram_runs": analysed}


# ----------------------------------------------------------------------------- plots


def _errorbars(ax, groups: list[dict], x, y: str, label: str, color: str, marker: str):
    """Mean over seeds of `y` against `x(group)`, bars from the seeds' min to max."""
    groups = sorted(groups, key=x)
    ys = [g[y] for g in groups]
    err = [[g[y] - g[f"{y}_min"] for g in groups], [g[f"{y}_max"] - g[y] for g in groups]]
    xs = [x(g) for g in groups]
    ax.errorbar(xs, ys, yerr=err, color=color, marker=marker, capsize=3, lw=1, label=label)
    return xs


def _log_x_ticks(ax, xs: list[float]) -> None:
    """Log x with a labelled tick at each measured x (a decade or less has no major ticks)."""
    from matplotlib.ticker import EngFormatter, NullFormatter

    ticks: list[float] = []
    for v in sorted(xs):
        if not ticks or v > ticks[-1] * 1.15:  # skip labels that would overlap
            ticks.append(v)
    ax.set_xscale("log")
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(EngFormatter(places=2 if max(xs) < 1 else 1))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelsize=7)


def plot_quality(groups: list[dict], out_dir: str, prefix: str, dpi: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = [g for g in groups if g["meta"]["kind"] == "baseline"]
    paths = []
    for x_key, y, xlabel, ylabel, name in (
        ("total_params", "loss", "total parameters", "val loss", "loss_vs_params"),
        ("flops_per_token", "loss", "training FLOPs per token", "val loss", "loss_vs_flops"),
        ("total_params", "step_s", "total parameters", "seconds per step", "step_time"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        xs, x_of = [], operator.itemgetter(x_key)
        for kind in ("engram", "ffn"):
            arms = base + [g for g in groups if g["meta"]["kind"] == kind]
            xs += _errorbars(ax, arms, x_of, y, f"+{kind}", *KIND_STYLE[kind])
        if base:
            _errorbars(ax, base, x_of, y, "baseline", *KIND_STYLE["baseline"])
        _log_x_ticks(ax, xs)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.set_title(f"{prefix}: {ylabel} (mean, min..max over seeds)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{prefix}_{name}.png"))
        fig.savefig(paths[-1], dpi=dpi)
        plt.close(fig)
    return paths


def plot_allocation(groups: list[dict], out_dir: str, prefix: str, dpi: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    _errorbars(ax, groups, lambda g: g["meta"]["rho"], "loss", "MoE + Engram", "tab:purple", "o")
    ax.set(xlabel="rho (fraction of the sparse budget in experts)", ylabel="val loss")
    ax.set_title(f"{prefix}: fixed sparse budget, fixed active compute", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}_loss_vs_rho.png")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return [path]


# ----------------------------------------------------------------------------- entry point


def write_report(
    experiment_dir: str,
    runs_dir: str,
    *,
    out_dir: str | None = None,
    setting: str | None = None,
    dpi: int = 90,
    echo: bool = True,
):
    """Regenerate `out_dir` (default `<experiment_dir>/results/`) from `runs_dir`; returns
    {name: path}. `setting` (the sweep's, when known) goes into every summary row.
    `runs_dir` must hold a sweep's runs and `out_dir` be new, empty or a report's output
    (`v41jax.train.workdir_kind`), checked before anything is read or written."""
    out_dir = out_dir or os.path.join(experiment_dir, "results")
    require_kind(runs_dir, "report-runs")
    require_kind(out_dir, "report")
    rows = collect_runs(runs_dir)
    os.makedirs(out_dir, exist_ok=True)
    # the keys first, then the rest; workdirs relative, so the file is portable
    summary = [
        {k: r[k] for k in SUMMARY_KEYS}
        | ({"setting": setting} if setting else {})
        | {k: v for k, v in r.items() if k not in SUMMARY_KEYS}
        | {"workdir": os.path.relpath(r["workdir"], runs_dir)}
        for r in rows
    ]
    written = {"summary": os.path.join(out_dir, "summary.json")}
    with open(written["summary"], "w") as f:
        json.dump(summary, f, indent=2)
    groups = group_arms(rows)
    plots = []
    for study in sorted({g["study"] for g in groups}):
        gs = [g for g in groups if g["study"] == study]
        layout = table_layout(gs)
        if layout == "quality":
            plots += plot_quality(gs, out_dir, study, dpi)
        elif layout == "allocation":
            plots += plot_allocation(gs, out_dir, study, dpi)
    s3 = study3(rows)
    if s3 is not None:
        written["study3"] = os.path.join(out_dir, "study3.json")
        with open(written["study3"], "w") as f:
            json.dump(s3, f, indent=2, default=str)
        s3 = json.loads(json.dumps(s3, default=str))  # render what the file holds
    text = render_tables(json.loads(json.dumps(summary)), s3, runs_dir)
    written["tables"] = os.path.join(out_dir, "tables.md")
    with open(written["tables"], "w") as f:
        f.write(text)
    if echo:
        print(text)
    written |= {os.path.basename(p)[:-4]: p for p in plots}
    return written


if __name__ == "__main__":  # python -m v41jax.sweep.report EXPERIMENT_DIR: tables.md again
    import sys

    exp = sys.argv[1] if len(sys.argv) > 1 else "experiments/engram_vs_ffn"
    md = render_from_results(exp)
    with open(os.path.join(exp, "results", "tables.md"), "w") as f:
        f.write(md)
    print(md)
