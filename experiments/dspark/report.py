"""Tables, plots and the issue's target checks from the DSpark experiment's summary.json.

python experiments/dspark/report.py [results_dir]     (regenerates from summary.json)
"""

from __future__ import annotations

import json
import os
import sys

from v41jax.dspark import analysis as A


def _best(rows, **match):
    rows = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def target_checks(summary: dict) -> list[dict]:
    """The issue's four targets, each with the measured numbers and a verdict."""
    s, rows = summary["stats"], summary["rows"]
    big = max(r["batch"] for r in rows)
    checks = []
    dsp, mtp, par = s.get("dspark fixed"), s.get("mtp1 fixed"), s.get("parallel fixed")
    if dsp and mtp:
        ratio = dsp["tokens_per_round"] / mtp["tokens_per_round"]
        checks.append(
            {
                "target": "DSpark tokens/round >= 1.6x MTP-1's",
                "measured": f"{dsp['tokens_per_round']:.3f} / {mtp['tokens_per_round']:.3f} = "
                f"{ratio:.2f}x",
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
        ece = dsp["calibration"]["ece"]
        length = dsp["calibration"]["length"]["ece_fraction"]
        checks.append(
            {
                "target": "calibration error <= 0.05",
                "measured": f"per-position ECE {ece:.3f}; accepted-length ECE {length:.3f} of K",
                "met": ece <= 0.05,
            }
        )
    sched = _best(rows, batch=big, mode="scheduled")
    fixed = _best(rows, batch=big, drafter="dspark", mode="fixed")
    if sched and fixed:
        gain = sched["tokens_per_s"] / fixed["tokens_per_s"]
        checks.append(
            {
                "target": f"batch {big}: scheduler beats the best fixed length",
                "measured": f"{sched['tokens_per_s']:.0f} vs {fixed['tokens_per_s']:.0f} "
                f"tok/s ({fixed['name']}): {gain:.3f}x",
                "met": gain > 1.0,
            }
        )
    return checks


def write_report(summary: dict, out_dir: str) -> str:
    """Write tables.md and the PNGs into out_dir; return the markdown."""
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
        "\n## Wall-clock throughput\n",
        A.markdown_table(sorted(rows, key=lambda r: (r["batch"], r["name"])), tput_cols),
        "\n## Realignment\n",
        A.markdown_table(re_rows, re_cols),
        "\n## The issue's targets\n",
        A.markdown_table(
            checks, [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")]
        ),
    ]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(text)
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
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(out, "summary.json")) as f:
        print(write_report(json.load(f), out))
