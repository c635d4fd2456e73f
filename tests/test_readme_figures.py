"""The READMEs' tables are renderings of the committed JSON, and their figures match it.

Convention: a README table copied from an experiment's `results/tables.md` sits between
`<!-- rendered from results/tables.md -->` and `<!-- end rendered -->`; each such block must
be a verbatim excerpt of tables.md, and tables.md must equal what the experiment's renderer
makes of the committed JSON now (no runs, no training: the runs/ directories need not exist).

Prose: every decimal figure in an experiment's README (outside code blocks, inline code and
the marked tables) must be found at its printed precision in that experiment's committed
JSON or tables.md, or be listed with its source in `tests/readme_figures_allowlist.py`
(see `untraced`).
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
    if experiment in ("mhc_stability", "spec_throughput", "dspark_deep", "dspark_load"):
        report = _module(f"experiments/{experiment}/report.py", f"{experiment}_report")
        return report.render_tables(_json("experiments", experiment, "results", "summary.json"))
    if experiment == "engram_scale":
        report = _module("experiments/engram_scale/report.py", "engram_scale_report")
        return report.render_tables(_json("experiments", "engram_scale", "results", "summary.json"))
    if experiment == "benchmarks":
        report = _module("experiments/benchmarks/report.py", "benchmarks_report")
        return report.render_tables(os.path.join(EXP, "benchmarks"))
    if experiment == "engram_optim":
        report = _module("experiments/engram_optim/report.py", "engram_optim_report")
        summary = _json("experiments", "engram_optim", "results", "summary.json")
        timing = _json("experiments", "engram_optim", "results", "timing.json")
        return report.render_tables(summary, timing)
    raise KeyError(experiment)


def rendered_blocks(readme: str) -> list[str]:
    """The text between each BEGIN and END marker (stripped of the newlines around it)."""
    pattern = re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END)
    blocks = re.findall(pattern, readme, flags=re.S)
    assert readme.count(BEGIN) == readme.count(END) == len(blocks), "unbalanced markers"
    return blocks


RENDERED = (
    "dspark", "engram_vs_ffn", "benchmarks", "mhc_stability", "spec_throughput", "engram_scale",
    "dspark_deep", "engram_optim", "dspark_load",
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


def test_sharded_lookup_ratios_in_the_docs_are_the_cost_model():
    from v41jax.engram.sharded_cost import lookup_bytes_per_token

    readme = _prose("docs", "engram.md")
    for devices, want in ((8, "12.7x"), (64, "101.6x"), (256, "406.4x")):
        args = (devices, 24, 128, 2)
        a2a = lookup_bytes_per_token("all_to_all", *args)["total"]
        psum = lookup_bytes_per_token("psum", *args)["total"]
        assert f"{psum / a2a:.1f}x" == want and want in readme
    assert "408x" not in readme and "(S - 1)x" not in readme


def test_docs_lookup_speedup_is_the_recorded_one():
    bw = {
        r["path"]: r["gb_per_s"]
        for r in _json("experiments", "benchmarks", "engram.json")["bandwidth"]
    }
    ratio = bw["xla engram_lookup"] / bw["jnp.take"]
    assert f"{ratio:.2f}x `jnp.take`" in _prose("docs", "engram.md")
    assert "~3x" not in _prose("docs", "engram.md")


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


def test_readme_quickstart_figures_are_the_committed_run():
    """The results table's quickstart loss is experiments/quickstart/eval.json's, and the
    quoted sample is in that run's samples.txt."""
    ev = _json("experiments", "quickstart", "eval.json")
    assert f"val loss **{ev['val_loss']:.4f}**" in _prose("README.md")
    quote = re.search(r"A quickstart sample .*?\n\n((?:> .*\n?)+)", _read("README.md")).group(1)
    text = " ".join(quote.replace("\n> ", " ").removeprefix("> ").split())
    assert text in " ".join(_read("experiments", "quickstart", "samples.txt").split())


# ----------------------------------------------------------------------------- prose
#
# A "decimal figure" is a number printed with a decimal point: 2.03, 0.016, 1.7x, 45.7%,
# 2.2e-5. Not figures: integers (1,024; 36 GiB), version numbers and dotted ids (0.10.2,
# V4.1, arXiv 2601.07372 is allowlisted), anything in a code block or inline code (commands,
# config values), and the marked tables (checked above). A figure with d decimals is traced
# when some number of the experiment's committed JSON files (any depth under its folder,
# numbers inside strings included) or of its results/tables.md, rounded to d decimals,
# prints as the figure; a unit after it allows the one conversion it names (% of a
# fraction, ms / us of seconds, GB / MB of bytes, GiB / MiB of bytes). A figure computed
# from two JSON values (a ratio, a difference) or taken from elsewhere is allowlisted with
# its source; an allowlist source that starts with a committed file's path and a colon
# ("experiments/dspark/results/tables.md: ...") is checked against that file.

FIGURE = re.compile(
    r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?)(?![\w.]*\.\d)(?!\d)"
    r"(?:\s?(%|ms|us|GB|GiB|MB|MiB|M|G|k)(?!\w))?"
)
UNIT_SCALE = {
    "": 1.0, "%": 100.0, "ms": 1e3, "us": 1e6, "GB": 1e-9, "MB": 1e-6,
    "GiB": 2.0**-30, "MiB": 2.0**-20, "M": 1e-6, "G": 1e-9, "k": 1e-3,
}  # fmt: skip
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of a README with code blocks, inline code, link targets and the
    marked tables blanked out (line numbers kept)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), blank, text, flags=re.S)
    text = re.sub(r"^\s*```.*?^\s*```", blank, text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", blank, text)
    text = re.sub(r"\]\([^)\s]*\)", blank, text)
    return list(enumerate(text.split("\n"), start=1))


def figures(text: str) -> list[tuple[int, str, str]]:
    """(line, figure, unit) for every decimal figure in the prose of `text`."""
    return [
        (n, m.group(1), m.group(2) or "")
        for n, line in prose_lines(text)
        for m in FIGURE.finditer(line)
    ]  # fmt: skip


def _numbers(obj, out: set) -> set:
    if isinstance(obj, bool) or obj is None:
        return out
    if isinstance(obj, (int, float)):
        out.add(abs(float(obj)))
    elif isinstance(obj, str):
        out.update(float(x) for x in _NUMBER.findall(obj.replace(",", "")))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _numbers(k, out)
            _numbers(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _numbers(v, out)
    return out


def source_numbers(*paths: str) -> set:
    """Every number in the given files (JSON parsed; any other file read as text)."""
    out: set = set()
    for path in paths:
        full = os.path.join(ROOT, path)
        with open(full) as f:
            _numbers(json.load(f) if path.endswith(".json") else f.read(), out)
    return out


def experiment_sources(experiment: str) -> list[str]:
    """The committed JSON files under experiments/<experiment>/ and its results/tables.md."""
    base = os.path.join("experiments", experiment)
    paths = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, base)):
        rel = os.path.relpath(dirpath, ROOT)
        paths += [os.path.join(rel, n) for n in sorted(names) if n.endswith(".json")]
    tables = os.path.join(base, "results", "tables.md")
    if os.path.exists(os.path.join(ROOT, tables)):
        paths.append(tables)
    return sorted(paths)


def _sci(x: float, d: int) -> str:
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.{d}e}").replace("e+", "e")


def is_traced(figure: str, unit: str, numbers: set) -> bool:
    mantissa = figure.split("e")[0]
    d = len(mantissa.split(".")[1])
    if "e" in figure:
        want = _sci(float(figure), d)
        return any(_sci(v, d) == want for v in numbers)
    scales = {1.0, UNIT_SCALE.get(unit, 1.0)}
    return any(f"{v * s:.{d}f}" == figure for v in numbers for s in scales)


def untraced(text: str, numbers: set, allowed=()) -> list[str]:
    """'line N: figure' for each figure of text's prose that numbers do not trace."""
    return [
        f"line {n}: {fig}{unit and ' ' + unit}"
        for n, fig, unit in figures(text)
        if fig not in allowed and not is_traced(fig, unit, numbers)
    ]  # fmt: skip


def _allowlist() -> dict:
    return _module("tests/readme_figures_allowlist.py", "readme_figures_allowlist").ALLOWED


EXPERIMENT_READMES = sorted(
    e for e in os.listdir(EXP) if os.path.exists(os.path.join(EXP, e, "README.md"))
)


@pytest.mark.parametrize("experiment", EXPERIMENT_READMES)
def test_every_decimal_figure_in_the_prose_traces_to_the_committed_results(experiment):
    readme = _read("experiments", experiment, "README.md")
    allowed = _allowlist().get(experiment, {})
    numbers = source_numbers(*experiment_sources(experiment))
    missing = untraced(readme, numbers, allowed)
    assert not missing, (
        f"experiments/{experiment}/README.md: figures found in none of "
        f"{experiment_sources(experiment)} and not allowlisted in "
        f"tests/readme_figures_allowlist.py:\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("experiment", EXPERIMENT_READMES)
def test_allowlisted_figures_are_in_the_prose_and_checked_where_a_file_is_named(experiment):
    printed = {fig for _, fig, _ in figures(_read("experiments", experiment, "README.md"))}
    for fig, source in _allowlist().get(experiment, {}).items():
        assert fig in printed, f"allowlisted {fig} is no longer in experiments/{experiment}"
        path = source.split(":")[0]
        if path.startswith("experiments/") and os.path.isfile(os.path.join(ROOT, path)):
            numbers = source_numbers(path)
            assert any(is_traced(fig, u, numbers) for u in UNIT_SCALE), f"{fig} not in {path}"


def test_prose_check_reports_a_made_up_figure():
    """Negative control: a figure in no source is named; traced, coded and tabled ones are not."""
    sample = "\n".join([
        "DSpark reached 2.03x plain (0.016 ECE, 45.7% MFU, 28.5 ms a round).",
        "The drafter reached 9.87x plain here.",
        "Run `--set optim.lr=3.21` on JAX 0.10.2 (DeepSeek-V4.1).",
        "```", "speedup 7.77", "```",
        BEGIN, "| a |", "| --- |", "| 6.66 |", END,
        "Also 1.3e-7 and 4.4e-4.",
    ])  # fmt: skip
    numbers = {2.0312, 0.0164, 0.457, 0.02851, 1.3e-7}
    assert untraced(sample, numbers) == ["line 2: 9.87", "line 12: 4.4e-4"]
    assert untraced(sample, numbers, {"9.87": "made up", "4.4e-4": "made up"}) == []
    assert [f for _, f, _ in figures(sample)] == [
        "2.03", "0.016", "45.7", "28.5", "9.87", "1.3e-7", "4.4e-4",
    ]  # fmt: skip
