"""Tables, plots and the issue's target checks from the DSpark experiment's summary.json.

python experiments/dspark/report.py [results_dir]                (tables.md and the PNGs)
python experiments/dspark/report.py [results_dir] --tables-only  (tables.md, no matplotlib)

`render_tables(summary)` is the whole of tables.md, a pure function of summary.json: the
README quotes its tables verbatim (`tests/test_readme_figures.py` checks both).
"""

from __future__ import annotations

import copy
import json
import os
import sys

from v41jax.dspark.analysis import round_logs as A


def _best(rows, **match):
    rows = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def target_checks(summary: dict) -> list[dict]:
    """The issue's four targets, each with the measured numbers and a verdict."""
    s = summary["stats"]
    checks = []
    dsp, mtp, par = s.get("dspark fixed"), s.get("mtp1 fixed"), s.get("parallel fixed")
    if dsp and mtp:
        ratio = dsp["tokens_per_round"] / mtp["tokens_per_round"]
        temps = summary.get("temperature_study", {})
        by_t = "; ".join(
            f"T={t}: {v['dspark']['tokens_per_round'] / v['mtp1']['tokens_per_round']:.2f}x"
            for t, v in temps.items()
            if "dspark" in v and "mtp1" in v
        )
        checks.append(
            {
                "target": "DSpark tokens/round >= 1.6x MTP-1's (at the main temperature)",
                "measured": f"{dsp['tokens_per_round']:.3f} / {mtp['tokens_per_round']:.3f} = "
                f"{ratio:.2f}x" + (f" (by temperature: {by_t})" if by_t else ""),
                "met": ratio >= 1.6,
            }
        )
    if dsp and par:
        later = [
            (d, p)
            for d, p in zip(dsp["acceptance"][1:], par["acceptance"][1:], strict=False)
            if d is not None and p is not None
        ]
        text = ", ".join(f"{d:.3f} vs {p:.3f}" for d, p in later)
        checks.append(
            {
                "target": "Markov head raises acceptance at positions >= 2",
                "measured": f"positions 2..K: {text}",
                "met": bool(later) and all(d > p for d, p in later),
            }
        )
    if dsp:
        cal = dsp["calibration"]
        per = ", ".join(f"{e:.3f}" for e in cal["ece_per_position"] if e is not None)
        length = cal["length"]["ece_fraction"]
        checks.append(
            {
                "target": "calibration error <= 0.05",
                "measured": f"pooled ECE {cal['ece']:.3f} (per position {per}); "
                f"accepted-length ECE {length:.3f} of K",
                "met": cal["ece"] <= 0.05,
            }
        )
    study = summary.get("scheduler_study")
    if study:
        cfg = study["configs"]
        med = {n: v["median_tokens_per_s"] for n, v in cfg.items()}
        best = max((n for n in med if n != "scheduled"), key=med.get)
        gain = med["scheduled"] / med[best]
        host = [n for n in med if n.endswith("host loop")]
        same_loop = ""
        if host:
            h = max(host, key=med.get)
            same_loop = f"; vs the best on its own loop, {h}: {med['scheduled'] / med[h]:.3f}x"
        model = {n: v["model_tokens_per_s"] for n, v in cfg.items() if "model_tokens_per_s" in v}
        by_model = ""
        if "scheduled" in model:  # the loop does not change a round's price: lengths only
            mb = max((n for n in model if n.startswith("fixed") and "host" not in n), key=model.get)
            by_model = (
                f"; cost model (wall-clock verdict unaffected): {model['scheduled']:.0f} vs "
                f"{model[mb]:.0f} ({mb}): {model['scheduled'] / model[mb]:.3f}x"
            )
        replay = ""
        if "replay" in study:  # the same rounds under every policy: the scheduler's headroom
            rp = study["replay"]
            fixed = max(rp["fixed"])
            sched = ", ".join(f"{x / fixed:.3f}x ({b} basis)" for b, x in rp["scheduled"].items())
            replay = (
                f"; replay of {rp['rounds']} rounds, vs the best fixed length: scheduler "
                f"{sched}, oracle bound {rp['oracle'] / fixed:.3f}x"
            )
        checks.append(
            {
                "target": f"batch {study['batch']}: scheduler beats the best fixed length",
                "measured": f"median {med['scheduled']:.0f} vs {med[best]:.0f} tok/s ({best}, "
                f"{len(cfg['scheduled']['tokens_per_s'])} interleaved passes): {gain:.3f}x"
                + same_loop
                + by_model
                + replay,
                "met": gain > 1.0,
            }
        )
    return checks


def study_tables(summary: dict) -> list[str]:
    """Markdown for the scheduler-vs-fixed and the temperature studies (if present)."""
    md = []
    study = summary.get("scheduler_study")
    if study:
        rows = [
            {
                "name": n,
                "med": v["median_tokens_per_s"],
                "lo": min(v["tokens_per_s"]),
                "hi": max(v["tokens_per_s"]),
                "len": v["mean_verify_len"],
                "tpr": v["tokens_per_round"],
                "model": v.get("model_tokens_per_s"),
                "loop": v.get("loop_rounds"),
                "row": v.get("row_rounds"),
            }
            for n, v in study["configs"].items()
        ]
        cols = [
            ("name", f"dspark, batch {study['batch']}", ""),
            ("med", "median tokens/s", ".1f"),
            ("lo", "min", ".1f"),
            ("hi", "max", ".1f"),
            ("len", "mean L", ".2f"),
            ("tpr", "tokens/round", ".3f"),
            ("model", "cost-model tokens/s", ".1f"),
            ("loop", "loop rounds", ""),
            ("row", "rounds per row", ".1f"),
        ]
        ct = study["cost_table"]
        pairs = zip(ct["tokens"], ct["seconds"], strict=True)
        secs = ", ".join(f"{t}: {1e3 * x:.1f} ms" for t, x in pairs)
        md += [
            "\n## Scheduler vs fixed verify length (interleaved passes)\n",
            A.markdown_table(rows, cols),
            f"\nRound-cost table (verified tokens: seconds per round): {secs}\n",
        ]
        md += replay_table(study.get("replay"))
    temps = summary.get("temperature_study")
    if temps:
        names = list(next(iter(temps.values())))
        rows = [{"t": t, **{n: v[n]["tokens_per_round"] for n in names}} for t, v in temps.items()]
        for r in rows:
            if "dspark" in r and "mtp1" in r:
                r["ratio"] = r["dspark"] / r["mtp1"]
        cols = [("t", "temperature", "")] + [(n, n, ".3f") for n in names]
        cols += [("ratio", "dspark / mtp1", ".2f")]
        md += ["\n## Tokens per round by temperature\n", A.markdown_table(rows, cols)]
    return md


def replay_table(rp: dict | None) -> list[str]:
    """Markdown: every width policy priced on the same logged rounds
    (v41jax.dspark.train.replay)."""
    if not rp:
        return []
    fixed = max(rp["fixed"])
    rows = [
        {"p": f"fixed L={w}", "thr": x, "rel": x / fixed, "w": float(w)}
        for w, x in enumerate(rp["fixed"], 1)
    ]
    for basis, x in rp["scheduled"].items():
        rows.append({"p": f"scheduled, {basis} basis", "thr": x, "rel": x / fixed,
                     "w": rp["scheduled_widths"][basis]})  # fmt: skip
    rows.append({"p": "oracle bound (sees acceptance)", "thr": rp["oracle"],
                 "rel": rp["oracle"] / fixed, "w": rp["oracle_widths"]})  # fmt: skip
    cols = [
        ("p", "policy", ""),
        ("thr", "tokens per cost-second", ".1f"),
        ("rel", "vs best fixed", ".3f"),
        ("w", "mean width", ".2f"),
    ]
    return [
        f"\n## Replay: width policies on the same {rp['rounds']} rounds (round-cost table)\n",
        A.markdown_table(rows, cols),
    ]


def wall_clock_table(rows: list[dict]) -> str:
    """Markdown: tokens/s of every decoder timed at every batch size (x plain decoding)."""
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    batches = sorted(plain)
    by_name: dict[str, dict] = {}
    for r in rows:
        by_name.setdefault(r["name"], {})[r["batch"]] = r["tokens_per_s"]
    out = []
    for name, tps in by_name.items():
        if sorted(tps) != batches:
            continue  # the ablations are timed at one batch size only (see the long table)
        cell = {b: f"{tps[b]:.1f}" for b in batches}
        if name != "plain":
            cell = {b: f"{tps[b]:.1f} ({tps[b] / plain[b]:.2f}x)" for b in batches}
        out.append({"name": name, **{f"b{b}": c for b, c in cell.items()}})
    cols = [("name", "decoder", "")] + [(f"b{b}", f"batch {b}", "") for b in batches]
    return A.markdown_table(out, cols)


def calibration_table(stats: dict) -> str:
    """Markdown: pooled and per-position confidence ECE, and the accepted-length ECE."""
    k_max = max(len(v["acceptance"]) for v in stats.values())
    out = []
    for name, v in stats.items():
        cal = v["calibration"]
        row = {"name": name, "ece": cal["ece"], "lt": cal["length"]["ece_tokens"]}
        row["lf"] = cal["length"]["ece_fraction"]
        row.update({f"e{j + 1}": e for j, e in enumerate(cal["ece_per_position"])})
        out.append(row)
    cols = [("name", "drafter", ""), ("ece", "pooled ECE", ".3f")]
    cols += [(f"e{j + 1}", f"ECE {j + 1}", ".3f") for j in range(k_max)]
    cols += [("lt", "length ECE (tok)", ".3f"), ("lf", "length ECE / K", ".3f")]
    return A.markdown_table(out, cols)


def render_tables(summary: dict) -> str:
    """tables.md from summary.json alone (the committed results re-render without runs/)."""
    summary = copy.deepcopy(summary)
    rows, stats = summary["rows"], summary["stats"]
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / plain[r["batch"]]
    k_max = max(len(v["acceptance"]) for v in stats.values())
    acc_rows = []
    for name, v in stats.items():
        row = {
            "name": name,
            "tpr": v["tokens_per_round"],
            "pred": v["predicted_tokens_per_round"],
            "ece": v["calibration"]["ece"],
            "lece": v["calibration"]["length"]["ece_tokens"],
            "len": v["mean_verify_len"],
        }
        row.update({f"a{j + 1}": a for j, a in enumerate(v["acceptance"])})
        acc_rows.append(row)
    acc_cols = [("name", f"drafter (batch {max(r['batch'] for r in rows)})", "")]
    acc_cols += [(f"a{j + 1}", f"acc {j + 1}", ".3f") for j in range(k_max)]
    acc_cols += [
        ("len", "mean L", ".2f"),
        ("tpr", "tokens/round", ".3f"),
        ("pred", "model", ".3f"),
        ("ece", "conf ECE", ".3f"),
        ("lece", "length ECE (tok)", ".3f"),
    ]
    tput_cols = [
        ("name", "decoder", ""),
        ("batch", "batch", "d"),
        ("tokens_per_s", "tokens/s", ".1f"),
        ("speedup", "vs plain", ".2f"),
        ("tokens_per_round", "tokens/round", ".3f"),
    ]
    re = summary["realignment"]
    re_rows = [
        {
            "name": n,
            "tpr": v["tokens_per_round"],
            **{f"a{j + 1}": a for j, a in enumerate(v["acceptance"])},
        }
        for n, v in re.items()
    ]
    re_cols = [("name", "drafter on post-trained target", "")]
    re_cols += [
        (f"a{j + 1}", f"acc {j + 1}", ".3f") for j in range(len(re["before"]["acceptance"]))
    ]
    re_cols += [("tpr", "tokens/round", ".3f")]
    checks = target_checks(summary)
    md = [
        "## Acceptance, tokens per round, calibration\n",
        A.markdown_table(acc_rows, acc_cols),
        "\n## Calibration per position\n",
        calibration_table(stats),
        "\n## Wall-clock throughput\n",
        A.markdown_table(sorted(rows, key=lambda r: (r["batch"], r["name"])), tput_cols),
        "\n## Wall-clock tokens/s by batch size (x plain decoding)\n",
        wall_clock_table(rows),
        "\n## Realignment\n",
        A.markdown_table(re_rows, re_cols),
        *study_tables(summary),
        "\n## The issue's targets\n",
        A.markdown_table(
            checks, [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")]
        ),
    ]
    return "\n".join(md) + "\n"


def write_report(summary: dict, out_dir: str, *, plots: bool = True) -> str:
    """Write tables.md (`render_tables`) and the PNGs into out_dir; return the markdown."""
    text = render_tables(summary)
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(text)
    if not plots:
        return text
    rows, stats = summary["rows"], summary["stats"]
    A.plot_acceptance(
        {n: v["acceptance"] for n, v in stats.items() if "scheduled" not in n},
        os.path.join(out_dir, "acceptance.png"),
    )
    A.plot_reliability(
        {n: v["calibration"] for n, v in stats.items() if n.startswith("dspark")},
        os.path.join(out_dir, "reliability.png"),
    )
    A.plot_throughput(
        [r for r in rows if " L=" not in r["name"]],  # drop the L sweep
        os.path.join(out_dir, "throughput.png"),
    )
    return text


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--tables-only"]
    out = args[0] if args else os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(out, "summary.json")) as f:
        print(write_report(json.load(f), out, plots="--tables-only" not in sys.argv))
