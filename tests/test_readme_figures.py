"""The READMEs' tables are renderings of the committed JSON, and README.md's figures match it.

Convention: a README table copied from an experiment's `results/tables.md` sits between
`<!-- rendered from results/tables.md -->` and `<!-- end rendered -->`; each such block must
be a verbatim excerpt of tables.md, and tables.md must equal what the experiment's renderer
makes of the committed JSON now (no runs, no training: the runs/ directories need not exist).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXP = os.path.join(ROOT, "experiments")
BEGIN, END = "<!-- rendered from results/tables.md -->", "<!-- end rendered -->"


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _json(*parts: str):
    return json.loads(_read(*parts))


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def render(experiment: str) -> str:
    if experiment == "dspark":
        report = _module("experiments/dspark/report.py", "dspark_report")
        return report.render_tables(_json("experiments", "dspark", "results", "summary.json"))
    if experiment == "engram_vs_ffn":
        from v41jax.sweep.report import render_from_results

        return render_from_results(os.path.join("experiments", "engram_vs_ffn"))
    if experiment in ("mhc_stability", "spec_throughput", "dspark_deep"):
        report = _module(f"experiments/{experiment}/report.py", f"{experiment}_report")
        return report.render_tables(_json("experiments", experiment, "results", "summary.json"))
    if experiment == "engram_scale":
        report = _module("experiments/engram_scale/report.py", "engram_scale_report")
        return report.render_tables(_json("experiments", "engram_scale", "results", "summary.json"))
    if experiment == "benchmarks":
        report = _module("experiments/benchmarks/report.py", "benchmarks_report")
        return report.render_tables(os.path.join(EXP, "benchmarks"))
    raise KeyError(experiment)


def rendered_blocks(readme: str) -> list[str]:
    """The text between each BEGIN and END marker (stripped of the newlines around it)."""
    pattern = re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END)
    blocks = re.findall(pattern, readme, flags=re.S)
    assert readme.count(BEGIN) == readme.count(END) == len(blocks), "unbalanced markers"
    return blocks


RENDERED = (
    "dspark", "engram_vs_ffn", "benchmarks", "mhc_stability", "spec_throughput", "engram_scale",
    "dspark_deep",
)  # fmt: skip


@pytest.mark.parametrize("experiment", RENDERED)
def test_tables_md_is_the_rendering_of_the_committed_json(experiment):
    assert _read("experiments", experiment, "results", "tables.md") == render(experiment)


@pytest.mark.parametrize("experiment", RENDERED)
def test_every_marked_readme_table_is_an_excerpt_of_tables_md(experiment):
    tables = _read("experiments", experiment, "results", "tables.md")
    readme = _read("experiments", experiment, "README.md")
    blocks = rendered_blocks(readme)
    assert blocks, f"experiments/{experiment}/README.md marks no rendered table"
    for block in blocks:
        assert block in tables, f"not in results/tables.md:\n{block}"


@pytest.mark.parametrize("experiment", RENDERED)
def test_every_readme_table_is_marked(experiment):
    """No hand-written table hides outside the markers (tables of commands are allowed)."""
    readme = _read("experiments", experiment, "README.md")
    outside = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), "", readme, flags=re.S)
    for header in re.findall(r"^\| (.*) \|\n\|( --- \|)+$", outside, flags=re.M):
        first = header[0].split(" | ")[0]
        assert first in ("command",), f"unmarked table: | {header[0]} |"


# ----------------------------------------------------------------------------- README.md


def _prose(*parts: str) -> str:
    """A README with its line breaks and indents folded to single spaces."""
    return " ".join(_read(*parts).split())


def test_sharded_lookup_ratios_in_the_readme_are_the_cost_model():
    from v41jax.engram.sharded_cost import lookup_bytes_per_token

    readme = _prose("README.md")
    for devices, want in ((8, "12.7x"), (64, "101.6x"), (256, "406.4x")):
        args = (devices, 24, 128, 2)
        a2a = lookup_bytes_per_token("all_to_all", *args)["total"]
        psum = lookup_bytes_per_token("psum", *args)["total"]
        assert f"{psum / a2a:.1f}x" == want and want in readme
    assert "408x" not in readme and "(S - 1)x" not in readme


def test_readme_lookup_speedup_is_the_recorded_one():
    bw = {
        r["path"]: r["gb_per_s"]
        for r in _json("experiments", "benchmarks", "engram.json")["bandwidth"]
    }
    ratio = bw["xla engram_lookup"] / bw["jnp.take"]
    assert f"{ratio:.2f}x `jnp.take`" in _prose("README.md")
    assert "~3x" not in _prose("README.md")


def test_readme_spec_throughput_greedy_acceptance_range():
    rows = _json("experiments", "spec_throughput", "results", "summary.json")["real"]["rows"]
    greedy = [a for r in rows if r["temperature"] == 0.0 for a in r["acceptance_per_position"]]
    assert f"{min(greedy):.2f}-{max(greedy):.2f} (greedy, per position)" in _prose("README.md")


def test_readme_results_row_numbers_come_from_the_json():
    readme = _prose("README.md")
    train = _json("experiments", "benchmarks", "train.json")["rows"][0]
    assert f"{train['tokens_per_s']:,.0f} tokens/s" in readme
    assert f"**{100 * train['mfu']:.1f}%**" in readme
    d = _json("experiments", "dspark", "results", "summary.json")
    s = d["stats"]
    for name in ("dspark fixed", "mtp1 fixed", "parallel fixed"):
        assert f"{s[name]['tokens_per_round']:.3f}" in readme
    assert f"confidence ECE {s['dspark fixed']['calibration']['ece']:.3f} (pooled)" in readme
    runs = _json("experiments", "engram_vs_ffn", "results", "summary.json")
    best = {r["arm"]: r["val_loss"] for r in runs if r["seed"] == 0}
    assert f"{best['engram_2M']:.4f}" in _prose("experiments", "engram_vs_ffn", "README.md")
