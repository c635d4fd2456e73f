"""The test tiers stay what scripts/test.sh says they are: the smoke tier reaches every part of
the package, and every end-to-end test (one that runs a v41jax command or an experiment script
in a subprocess) is marked `e2e`, so `bash scripts/test.sh --e2e` selects exactly those."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _is_sys_executable(node) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "executable"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def starts_a_command(node) -> bool:
    """`node` holds a command list `[sys.executable, ...]` that runs v41jax (`-m v41jax...`) or
    a script; `python -c` snippets and other tools' modules (`-m ruff`) are not end to end."""
    for n in ast.walk(node):
        if isinstance(n, ast.List | ast.Tuple) and n.elts and _is_sys_executable(n.elts[0]):
            rest = [e.value if isinstance(e, ast.Constant) else None for e in n.elts[1:3]]
            if rest[:1] == ["-c"]:
                continue
            if rest[:1] == ["-m"] and not str(rest[1:2] and rest[1]).startswith("v41jax"):
                continue
            return True
    return False


def unmarked_end_to_end_tests(path: pathlib.Path) -> list[str]:
    """Tests in `path` that start a command, directly or through a module-level helper or
    fixture of the same file (followed by name), and carry no `e2e` mark."""
    tree = ast.parse(path.read_text())
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    module_marked = any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
        and "e2e" in ast.unparse(n.value)
        for n in tree.body
    )

    def names_in(fn) -> set[str]:
        return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {
            a.arg for a in fn.args.args
        }

    def runs(fn, seen: frozenset) -> bool:
        if starts_a_command(fn):
            return True
        return any(
            runs(helpers[n], seen | {n}) for n in names_in(fn) if n in helpers and n not in seen
        )

    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        tests += [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    return [
        t.name
        for t in tests
        if t.name.startswith("test")
        and not module_marked
        and not any("e2e" in ast.unparse(d) for d in t.decorator_list)
        and runs(t, frozenset({t.name}))
    ]


def test_every_end_to_end_test_is_marked_e2e():
    found = {
        str(p.relative_to(ROOT)): names
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if (names := unmarked_end_to_end_tests(p))
    }
    assert not found, f"mark these @pytest.mark.e2e: {found}"


def test_the_e2e_check_follows_helpers_and_fixtures(tmp_path):
    """Negative control: an unmarked test that runs the CLI through a helper, or through a
    fixture, is named; a marked one, and one that runs `python -c`, are not."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import subprocess, sys\nimport pytest\n\n"
        "def _cli(*a):\n    return subprocess.run([sys.executable, '-m', 'v41jax', *a])\n\n"
        "@pytest.fixture\ndef trained():\n    return _cli('train')\n\n"
        "def test_via_helper():\n    _cli('eval')\n\n"
        "def test_via_fixture(trained):\n    pass\n\n"
        "@pytest.mark.e2e\ndef test_marked():\n    _cli('eval')\n\n"
        "def test_snippet():\n    subprocess.run([sys.executable, '-c', 'print(1)'])\n\n"
        "def test_ruff():\n    subprocess.run([sys.executable, '-m', 'ruff'])\n"
    )
    assert unmarked_end_to_end_tests(probe) == ["test_via_helper", "test_via_fixture"]


def test_the_e2e_marker_is_declared_and_selected_by_the_test_script():
    assert '"e2e:' in (ROOT / "pyproject.toml").read_text()
    assert 'marker="e2e and not slow"' in (ROOT / "scripts" / "test.sh").read_text()


def test_smoke_tier_lists_existing_files_of_every_part():
    """tests/smoke_files.txt (bash scripts/test.sh --smoke) names test files that exist and
    reaches every part of the package that has tests (each tests/ folder but aot)."""
    listed = [
        line
        for line in (ROOT / "tests" / "smoke_files.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    missing = [f for f in listed if not (ROOT / f).is_file()]
    assert not missing, missing
    parts = {p.parent.name for p in (ROOT / "tests").glob("*/test_*.py")} - {"aot"}
    reached = {pathlib.Path(f).parent.name for f in listed}
    assert parts <= reached, sorted(parts - reached)


def test_the_tier_times_quoted_are_the_recorded_ones():
    """README.md and experiments/test_tiers/README.md quote experiments/test_tiers/tiers.json
    (written by scripts/record_test_tiers.py): times, test counts, the commit."""
    import json

    tiers = json.loads((ROOT / "experiments" / "test_tiers" / "tiers.json").read_text())
    smoke, full = tiers["smoke"], tiers["full"]
    assert smoke["passed"] and full["passed"]
    (smoke_run,) = smoke["pytest_runs"]
    fast, aot = full["pytest_runs"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"the smoke tier took {smoke['seconds']:,.0f} s ({smoke_run['counts']['passed']:,} "
        f"tests) and the whole test command {full['seconds']:,.0f} s "
        f"({fast['counts']['passed']:,} fast tests and {aot['counts']['passed']:,} "
        "compile-tier tests)"
    ) in readme
    page = " ".join((ROOT / "experiments" / "test_tiers" / "README.md").read_text().split())
    assert f"at commit {full['commit'][:7]}" in page and full["commit"] == smoke["commit"]
    assert f"| {smoke['seconds']:,.0f} s ({smoke['seconds'] / 60:.0f} min) |" in page
    assert f"| {full['seconds']:,.0f} s ({full['seconds'] / 60:.0f} min) |" in page
    assert (
        f"fast suite {fast['counts']['passed']:,} passed, {fast['counts']['skipped']} skipped; "
        f"compile tier {aot['counts']['passed']} passed"
    ) in page
