"""The sweep report's markdown tables: pure functions of summary.json and study3.json.

`render_tables(summary, study3)` is what `write_report` writes as tables.md, and
`render_from_results(experiment_dir)` renders it again from an experiment's committed
`results/` alone, so the READMEs' tables can be checked against the JSON they come from.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from typing import Any

from v41jax.sweep.analysis import BIGRAM_BUCKETS, WORD_BUCKETS
from v41jax.sweep.driver import default_runs_dir

ACCOUNTING_KEYS = ("total_params", "active_params", "flops_per_token", "engram_params")
KIND_STYLE = {"baseline": ("k", "o"), "engram": ("tab:blue", "s"), "ffn": ("tab:orange", "^")}


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


def table_layout(groups: list[dict]) -> str:
    metas = [g["meta"] for g in groups]
    if all(m.get("kind") in KIND_STYLE for m in metas):
        return "quality"
    if all("rho" in m for m in metas):
        return "allocation"
    return "generic"


def study_table(groups: list[dict]) -> str:
    layout = table_layout(groups)
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
    """tables.md from summary.json's rows and study3.json (None: no Study 3 section). Rows
    of a setting other than "full" (their "setting" key) name it in the heading."""
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
        diff = quality_differences_table(gs) if table_layout(gs) == "quality" else None
        if diff:
            sections.append(f"## {study}: differences of the means\n\n{diff}")
    settings = sorted({r["setting"] for r in summary if r.get("setting", "full") != "full"})
    of = f"; setting {', '.join(settings)}" if settings else ""
    head = f"# Results ({len(summary)} runs from {source}{of})" if source else "# Results"
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
