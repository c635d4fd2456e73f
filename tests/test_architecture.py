"""The architecture stays visible: one-way imports, no private names taken across modules,
small files, lint-clean code.

The layer order enforced (a module imports only its own layer and layers to its left):

    ops -> config -> sharding -> data -> kernels -> engram -> mhc -> speculative -> model
        -> decode -> train -> hf -> dspark -> sweep -> bench

with no exemptions; `v41jax/__init__.py` and `__main__.py` sit on top. The README states the
same order (test_readme_states_the_enforced_layer_order).
"""

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "v41jax"
# A layer may import only from itself and layers to its left: ops (numerical primitives) at
# the bottom imports nothing else from v41jax; config (plain-Python dataclasses, including the
# feature configs EngramConfig and MHCConfig) may import only ops; sharding sits beside it.
LAYERS = [
    "ops",
    "config",
    "sharding",
    "data",
    "kernels",
    "engram",
    "mhc",
    "speculative",
    "model",
    "decode",
    "train",
    "hf",
    "dspark",
    "sweep",
    "bench",
]
# Files of one concept: about 400-600 lines. 600 is the hard stop; a file is cut along its
# concepts well before, never squeezed under a line count (private names stay private:
# test_no_private_names_across_modules).
MAX_LINES = 600


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "v41jax" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("v41jax", *parts))


def _imports(path: pathlib.Path):
    """Every module `path` imports, absolute: `from v41jax import x` counts as `v41jax.x`
    (a bare `v41jax` import would hide the layer) and relative imports are resolved."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).rstrip(".")
            if base == "v41jax":
                yield from (f"v41jax.{a.name}" for a in node.names)
            elif base:
                yield base
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_imports_flow_one_way():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        here = _layer(_module_name(path))
        if here is None:  # v41jax/__init__.py, __main__.py: the top, may import anything
            continue
        for module in _imports(path):
            there = _layer(module)
            if there and LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{path.relative_to(PACKAGE)} ({here}) imports {module} ({there})")
    assert not bad, bad


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_used_across_modules(path: pathlib.Path) -> list[str]:
    """`from v41jax.x import _y` and `x._y` (x a v41jax module bound by an import) in `path`:
    each as "line: module._name". A module's private names are its own; what another
    module needs is public."""
    tree = ast.parse(path.read_text())
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    bound: dict[str, str] = {}  # local name -> the v41jax module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("v41jax"):
            for a in node.names:
                if _private(a.name):
                    found.append(f"{node.lineno}: {node.module}.{a.name}")
                elif f"{node.module}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("v41jax") and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and _private(node.attr)
        ):
            found.append(f"{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return found


def test_no_private_names_across_modules():
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted(PACKAGE.rglob("*.py"))
        if (hits := private_names_used_across_modules(p))
    }
    assert not found, found


def test_private_name_check_catches_both_forms(tmp_path):
    """Negative control: a module that takes a private name both ways is named twice."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "from v41jax.model.generate import _helper\n"
        "from v41jax.dspark import train as T\n"
        "x = T._relative\n"
    )
    hits = private_names_used_across_modules(bad)
    assert hits == ["1: v41jax.model.generate._helper", "3: v41jax.dspark.train._relative"]


def test_every_subpackage_has_a_layer():
    """A new top-level package must be placed in LAYERS, or its imports go unchecked."""
    tops = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tops |= {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    assert tops - {"configs"} <= set(LAYERS), sorted(tops - {"configs"} - set(LAYERS))


def test_config_import_is_light():
    """Importing the config layer loads no jax, flax or kernel: configs are plain data."""
    code = (
        "import sys, v41jax.config\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')\n"
        "               or m.startswith(('v41jax.kernels', 'v41jax.engram', 'v41jax.mhc')))\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_files_stay_small():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, long


def test_training_data_is_read_through_load_data():
    """Whatever reads a run's training data (drafter training, self-text, analyses, the
    loop) takes it from `load_data`, which honours data.token_dir; only the data package
    itself tokenizes the corpus in memory with `prepare_data`."""
    direct = [
        str(p.relative_to(ROOT))
        for p in [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]
        if PACKAGE / "data" not in p.parents and re.search(r"\bprepare_data\(", p.read_text())
    ]
    assert not direct, f"call load_data (data.token_dir) instead of prepare_data: {direct}"


def test_one_step_loop():
    """Both trainers (train, train-drafter) run `v41jax.train.steploop.run_steps`: nothing
    else in the package latches the stop signal or agrees a stop, so no second loop decides
    on its own when to log, checkpoint or stop."""
    own = PACKAGE / "train" / "steploop.py"
    others = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if p != own and re.search(r"\b(StopSignal|AgreedStop)\(", p.read_text())
    ]
    assert not others, f"run the loop through v41jax.train.steploop.run_steps: {others}"
    users = {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "run_steps(" in p.read_text()
    }
    assert {"train/loop.py", "dspark/train/loop.py"} <= users, users


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


def test_readme_states_the_enforced_layer_order():
    """The order in this module's docstring and in the README is LAYERS."""
    assert " -> ".join(LAYERS) in " ".join(__doc__.split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"Imports go one way: `([^`]*)`", readme).group(1)
    order = [part.strip() for step in stated.split("->") for part in step.split(",")]
    assert order[: len(LAYERS)] == LAYERS and order[len(LAYERS) :] == ["experiments"], order
