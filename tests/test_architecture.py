"""The architecture stays visible: one-way imports, small files, lint-clean code."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "v41jax"
# A layer may import only from layers to its left (config and sharding sit below everything).
LAYERS = [
    "config",
    "sharding",
    "data",
    "kernels",
    "engram",
    "mhc",
    "spec",
    "model",
    "train",
    "dspark",
    "sweep",
    "bench",
]
# Leaf config dataclasses of a feature package belong to the config layer (config.py nests them).
CONFIG_MODULES = ("v41jax.engram.config", "v41jax.mhc.config")
MAX_LINES = 400


def _layer(module: str) -> str | None:
    if module in CONFIG_MODULES:
        return "config"
    parts = module.split(".")
    if parts[0] != "v41jax" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_imports_flow_one_way():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        here = _layer("v41jax." + ".".join(rel.with_suffix("").parts)) or ""
        if here not in LAYERS:
            continue
        for module in _imports(path):
            there = _layer(module)
            if there and LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{rel} imports {module}")
    assert not bad, bad


def test_files_stay_small():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long


def test_ruff_clean():
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run(
        [*ruff, "check", "v41jax", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run(
        [*ruff, "format", "--check", "v41jax", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout
