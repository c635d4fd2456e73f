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
import statistics
from collections import defaultdict
from typing import Any

from v41jax.sweep.analysis import BIGRAM_BUCKETS, WORD_BUCKETS, load_or_run_analysis
from v41jax.sweep.driver import RESULT_FILE, default_runs_dir

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
ACCOUNTING_KEYS = ("total_params", "active_params", "flops_per_token", "engram_params")
KIND_STYLE = {"baseline": ("k", "o"), "engram": ("tab:blue", "s"), "ffn": ("tab:orange", "^")}


def collect_runs(runs_dir: str) -> list[dict]:
    """One summary row per `<runs_dir>/<study>/<run>/result.json`, sorted by study, arm, seed."""
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"runs dir {runs_dir!r} does not exist; run the sweep first")
    rows = []
    for path in glob.glob(os.path.join(runs_dir, "*", "*", RESULT_FILE)):
        with open(path) as f:
            res = json.load(f)
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


def group_arms(rows: list[dict]) -> list[dict]:
    """Per (study, arm): seeds, val loss mean/min/max, and the mean of the other numbers."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["study"], r["arm"])].append(r)
    out = []
    for (study, arm), rs in groups.items():
        g = {"study": study, "arm": arm, "meta": rs[0]["meta"], "seeds": [r["seed"] for r in rs]}
        for name, key in (("loss", "val_loss"), ("step_s", "step_s")):
            vals = [r[key] for r in rs]
            g |= {name: statistics.fmean(vals), f"{name}_min": min(vals), f"{name}_max": max(vals)}
        for k in (*ACCOUNTING_KEYS, "wall_s", "tokens_seen", "mean_moe_dropped_fraction"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            g[k] = statistics.fmean(vals) if vals else None
        out.append(g)
    return out


# ----------------------------------------------------------------------------- tables


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "nan"
    a = abs(x)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= scale:
            return f"{x / scale:.{digits}g}{suffix}"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _md(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _loss_cells(g: dict) -> list[str]:
    return [f"{g['loss']:.4f}", f"[{g['loss_min']:.4f}, {g['loss_max']:.4f}]", len(g["seeds"])]


def _layout(groups: list[dict]) -> str:
    metas = [g["meta"] for g in groups]
    if all(m.get("kind") in KIND_STYLE for m in metas):
        return "quality"
    if all("rho" in m for m in metas):
        return "allocation"
    return "generic"


def study_table(groups: list[dict]) -> str:
    layout = _layout(groups)
    common = ["total params", "active params", "FLOPs/token", "val loss", "[min, max]", "seeds"]

    def cells(g: dict) -> list:
        acc = [_num(g["total_params"]), _num(g["active_params"]), _num(g["flops_per_token"])]
        return acc + _loss_cells(g)

    if layout == "quality":
        order = {"baseline": 0, "engram": 1, "ffn": 2}
        groups = sorted(
            groups, key=lambda g: (order[g["meta"]["kind"]], g["meta"].get("p_added", 0))
        )
        header = ["arm", "kind", "P added", *common, "s/step"]
        rows = [
            [g["arm"], g["meta"]["kind"], _num(g["meta"].get("p_added", 0)), *cells(g)]
            + [_num(g["step_s"])]
            for g in groups
        ]
    elif layout == "allocation":
        groups = sorted(groups, key=lambda g: g["meta"]["rho"])
        header = ["rho", "experts", "Engram params", *common, "dropped", "s/step"]
        rows = [
            [g["meta"]["rho"], g["meta"].get("num_experts", "-"), _num(g["engram_params"])]
            + [*cells(g), _num(g["mean_moe_dropped_fraction"], 2), _num(g["step_s"])]
            for g in groups
        ]
    else:
        header = ["arm", *common, "s/step"]
        rows = [[g["arm"], *cells(g), _num(g["step_s"])] for g in groups]
    return _md(header, rows)


def study3_table(study3: dict) -> str:
    best, others = study3["best"], study3["compare"]
    header = ["tokens", "share", "Engram on", "Engram off", "off - on"]
    header += [f"{name} ({r['arm']})" for name, r in others.items()]
    rows = []
    for group, buckets in (
        ("all", ("all",)),
        ("context_bigram", BIGRAM_BUCKETS),
        ("word", WORD_BUCKETS),
    ):
        for b in buckets:
            s = best["groups"][group][b]
            row = [f"{group}: {b}" if group != "all" else "all", f"{s['share']:.1%}"]
            row += [f"{s['loss']:.4f}", f"{s['loss_engram_off']:.4f}", f"{s['delta']:+.4f}"]
            row += [f"{r['groups'][group][b]['loss']:.4f}" for r in others.values()]
            rows.append(row)
    head = (
        f"Best Engram model: `{best['run']}` (val loss {best['val_loss']:.4f}); surgery check "
        f"max |logit diff| vs the model without Engram = {best['check_max_abs_logit_diff']:.2e}."
        f" Bigram buckets: rare < {best['thresholds']['rare_below']} <= medium < "
        f"{best['thresholds']['frequent_from']} <= frequent (training-stream counts).\n\n"
    )
    every = _md(
        ["run", "val loss", "off - on: all", "rare", "frequent", "continuation"],
        [
            [a["run"], f"{a['val_loss']:.4f}"]
            + [f"{a['groups'][g][b]['delta']:+.4f}" for g, b in _DELTA_COLUMNS]
            for a in study3["all_engram_runs"]
        ],
    )
    return head + _md(header, rows) + "\n\nEvery analysed Engram run:\n\n" + every


_DELTA_COLUMNS = (
    ("all", "all"),
    ("context_bigram", "rare"),
    ("context_bigram", "frequent"),
    ("word", "continuation"),
)


def _int(x: Any) -> str:
    return "-" if x is None else f"{round(x):,}"


def accounting_table(rows: list[dict]) -> str:
    """Per (study, arm), from its first seed: exact parameter counts and FLOPs per token."""
    header = ["study", "arm", "total params", "active params", "Engram params", "FLOPs/token"]
    header, seen, out = [*header, "d_ff", "experts"], set(), []
    for r in rows:
        if (r["study"], r["arm"]) in seen:
            continue
        seen.add((r["study"], r["arm"]))
        m = r["meta"]
        out.append(
            [r["study"], r["arm"], _int(r["total_params"]), _int(r["active_params"])]
            + [_int(r["engram_params"]), _num(r["flops_per_token"])]
            + [m.get("d_ff", "-"), m.get("num_experts", "-")]
        )
    return _md(header, out)


def runs_table(rows: list[dict]) -> str:
    """Seconds per step of every run, by seed, with the slowest / fastest seed; total wall."""
    seeds = sorted({r["seed"] for r in rows})
    by_arm: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        by_arm[(r["study"], r["arm"])][r["seed"]] = r
    header = ["study", "arm", *(f"s/step seed {s}" for s in seeds), "max / min", "wall_s"]
    out = []
    for (study, arm), rs in by_arm.items():
        steps = [rs[s]["step_s"] for s in seeds if rs.get(s, {}).get("step_s")]
        cells = [f"{v:.3f}" if (v := rs.get(s, {}).get("step_s")) else "-" for s in seeds]
        ratio = f"{max(steps) / min(steps):.2f}" if steps else "-"
        wall = sum(r.get("wall_s") or 0.0 for r in rs.values())
        out.append([study, arm, *cells, ratio, f"{wall:.0f}"])
    total = sum(r.get("wall_s") or 0.0 for r in rows)
    hours, minutes = divmod(round(total / 60), 60)
    return _md(header, out) + (
        f"\n\nWall-clock of all {len(rows)} runs (wall_s summed): {total:.0f} s = "
        f"{hours} h {minutes} min."
    )


def quality_differences_table(groups: list[dict]) -> str | None:
    """Quality layout: per P, the mean val-loss differences and FLOPs ratios of the arms."""
    base = [g for g in groups if g["meta"].get("kind") == "baseline"]
    if len(base) != 1:
        return None
    b = base[0]
    pairs: dict[Any, dict] = defaultdict(dict)
    for g in groups:
        if g["meta"].get("kind") in ("engram", "ffn"):
            pairs[g["meta"].get("p_index")][g["meta"]["kind"]] = g
    header = ["P added", "Engram - FFN", "Engram - baseline", "FFN - baseline"]
    header += ["FLOPs Engram / baseline", "FLOPs FFN / baseline", "FLOPs Engram / FFN"]
    out = []
    matched = [pr for pr in pairs.values() if set(pr) == {"engram", "ffn"}]
    for pr in sorted(matched, key=lambda pr: pr["engram"]["meta"].get("p_added", 0)):
        e, f = pr["engram"], pr["ffn"]
        out.append(
            [_num(e["meta"].get("p_added", 0))]
            + [f"{e['loss'] - f['loss']:+.4f}", f"{e['loss'] - b['loss']:+.4f}"]
            + [f"{f['loss'] - b['loss']:+.4f}"]
            + [f"{e['flops_per_token'] / b['flops_per_token']:.3f}"]
            + [f"{f['flops_per_token'] / b['flops_per_token']:.3f}"]
            + [f"{e['flops_per_token'] / f['flops_per_token']:.3f}"]
        )
    return _md(header, out) if out else None


def render_tables(summary: list[dict], study3: dict | None = None, source: str = "") -> str:
    """tables.md from summary.json's rows and study3.json (None: no Study 3 section)."""
    groups = group_arms(summary)
    sections = []
    for study in sorted({g["study"] for g in groups}):
        gs = [g for g in groups if g["study"] == study]
        sections.append(f"## {study}\n\n{study_table(gs)}")
    if study3 is not None:
        sections.append(f"## what the memory holds (Study 3)\n\n{study3_table(study3)}")
    sections.append(f"## accounting\n\n{accounting_table(summary)}")
    sections.append(f"## seconds per step by run\n\n{runs_table(summary)}")
    for study in sorted({g["study"] for g in groups}):
        gs = [g for g in groups if g["study"] == study]
        diff = quality_differences_table(gs) if _layout(gs) == "quality" else None
        if diff:
            sections.append(f"## {study}: differences of the means\n\n{diff}")
    head = f"# Results ({len(summary)} runs from {source})" if source else "# Results"
    return f"{head}\n\n" + "\n\n".join(sections) + "\n"


def render_from_results(experiment_dir: str, source: str | None = None) -> str:
    """tables.md of `<experiment_dir>/results/` from its summary.json and study3.json."""
    out_dir = os.path.join(experiment_dir, "results")
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    s3 = None
    if os.path.exists(s3_path := os.path.join(out_dir, "study3.json")):
        with open(s3_path) as f:
            s3 = json.load(f)
    return render_tables(summary, s3, source or default_runs_dir(experiment_dir))


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


def write_report(experiment_dir: str, runs_dir: str, *, dpi: int = 90, echo: bool = True):
    """Regenerate `<experiment_dir>/results/` from `runs_dir`; returns {name: path}."""
    rows = collect_runs(runs_dir)
    out_dir = os.path.join(experiment_dir, "results")
    os.makedirs(out_dir, exist_ok=True)
    # the keys first, then the rest; workdirs relative, so the file is portable
    summary = [
        {k: r[k] for k in SUMMARY_KEYS}
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
        layout = _layout(gs)
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
