"""Every file the docs point to exists, and nothing points outside the repository.

Checked sources: README.md, docs/*.md, experiments/README.md, experiments/*/README.md, and the
docstrings and comments of v41jax/**/*.py. In them:

- relative Markdown links `[text](target)` (and images) must resolve from the file's folder
  (URLs and `#anchors` are skipped; a `#fragment` is dropped);
- path-like references that start at a top-level folder of the repository (`v41jax/`,
  `tests/`, `docs/`, `experiments/`, `scripts/`, `examples/`) must exist, relative to the
  repository root. Globs and templates (`tests/**/test_*.py`, `experiments/*/README.md`,
  `loop_round_cost_b{B}_s{S}.json`, `experiments/.../README.md`) are not references and are
  skipped, as is anything inside a longer path (`runs/dspark/drafters/...`);
- dotted module references `v41jax.a.b[.name]` must name a module or package of the
  repository, and a trailing name after the module must occur in that module's source.

And no file of the repository (tracked or not ignored) mentions the background notes file or
the shared folder outside the checkout.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_DIRS = ("v41jax", "tests", "docs", "experiments", "scripts", "examples")

# Built from pieces so that this file does not itself contain what it forbids.
BANNED = (
    "REFERENCE" + ".md",
    ".." + "/shared",
    "/work" + "/shared",
    "shared" + "/seeds",
)

_PATH_RE = re.compile(r"(?<![\w./~$-])((?:" + "|".join(TOP_DIRS) + r")/[\w./*?{}<>\[\]-]*)")
_MODULE_RE = re.compile(r"(?<![\w./-])(v41jax(?:\.[A-Za-z_]\w*)+)")
_LINK_RE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TEMPLATE_CHARS = set("*?{}<>[]")


# ----------------------------------------------------------------------------- extraction


def _markdown_files(root: Path) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    files += [root / "experiments" / "README.md", *sorted(root.glob("experiments/*/README.md"))]
    return [f for f in files if f.is_file()]


def _python_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    src = path.read_text(encoding="utf-8")
    out: list[tuple[int, str]] = []
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                start = node.body[0].lineno
                out += [(start + i, line) for i, line in enumerate(doc.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _sources(root: Path) -> list[tuple[Path, list[tuple[int, str]]]]:
    """(file, [(line number, text)]) of every checked source."""
    sources = []
    for md in _markdown_files(root):
        lines = md.read_text(encoding="utf-8").splitlines()
        sources.append((md, list(enumerate(lines, start=1))))
    for py in sorted((root / "v41jax").rglob("*.py")):
        sources.append((py, _python_text(py)))
    return sources


def path_refs(text: str) -> list[str]:
    """Repository paths referenced in `text` (globs and templates left out)."""
    refs = []
    for m in _PATH_RE.finditer(text):
        ref = m.group(1).rstrip(".,:;")
        if _TEMPLATE_CHARS & set(ref) or "..." in ref or "/." in ref.rstrip("/"):
            continue
        refs.append(ref)
    return refs


def module_refs(text: str) -> list[str]:
    return [m.group(1) for m in _MODULE_RE.finditer(text)]


def link_targets(text: str) -> list[str]:
    """Relative Markdown link targets in `text`, without their #fragment."""
    out = []
    for m in _LINK_RE.finditer(text):
        target = m.group(1)
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        out.append(target.split("#", 1)[0])
    return [t for t in out if t]


# ----------------------------------------------------------------------------- resolution


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def module_problem(root: Path, dotted: str) -> str | None:
    """None if `dotted` names a module of the repository (optionally followed by a name
    that occurs in that module's source), else what is wrong."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        found = _module_file(root, parts[:i])
        if found is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        if re.search(rf"\b{re.escape(rest[0])}\b", found.read_text(encoding="utf-8")):
            return None
        return f"{rest[0]!r} does not occur in {found.relative_to(root)}"
    return "no such module"


def dangling(root: Path) -> list[str]:
    """One line `file:line: reference (why)` per dangling reference under `root`."""
    problems = []
    for path, lines in _sources(root):
        rel = path.relative_to(root)
        is_md = path.suffix == ".md"
        for lineno, text in lines:
            where = f"{rel}:{lineno}"
            for ref in path_refs(text):
                if not (root / ref).exists():
                    problems.append(f"{where}: {ref} (no such file)")
            for dotted in module_refs(text):
                why = module_problem(root, dotted)
                if why:
                    problems.append(f"{where}: {dotted} ({why})")
            if is_md:
                for target in link_targets(text):
                    base = root if target.startswith("/") else path.parent
                    if not (base / target.lstrip("/")).exists():
                        problems.append(f"{where}: link {target} (no such file)")
    return problems


def _repository_files(root: Path) -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else a walk without caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
        return [root / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            files += [Path(dirpath) / f for f in filenames]
        return files


def banned_mentions(root: Path) -> list[str]:
    problems = []
    for path in _repository_files(root):
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        lowered = text.lower()
        for needle in BANNED:
            if needle.lower() in lowered:
                line = lowered[: lowered.index(needle.lower())].count("\n") + 1
                problems.append(f"{path.relative_to(root)}:{line}: mentions {needle}")
    return problems


# ----------------------------------------------------------------------------- tests


def test_no_dangling_references():
    problems = dangling(ROOT)
    assert not problems, "dangling references:\n" + "\n".join(problems)


def test_nothing_refers_outside_the_repository():
    problems = banned_mentions(ROOT)
    assert not problems, "references outside the repository:\n" + "\n".join(problems)


MANUAL = (
    "training",
    "workdirs",
    "launching",
    "accelerators",
    "hf",
    "engram",
    "mhc",
    "speculative",
    "dspark",
)


def test_docs_pages_exist_and_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in MANUAL:
        assert (ROOT / "docs" / f"{page}.md").is_file()
        assert f"](docs/{page}.md)" in readme, f"README.md does not link docs/{page}.md"
    unlisted = {p.stem for p in (ROOT / "docs").glob("*.md")} - set(MANUAL)
    assert not unlisted, f"docs pages the README's manual table does not list: {unlisted}"


def test_readme_is_a_front_door_not_the_manual():
    """The README says what v41jax is, how to install and test it, the CLI at a glance, the
    layout, the results and where the manual is; the manual lives in docs/."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250, len(readme.splitlines())
    for heading in (
        "## Install and the two commands",
        "## CLI",
        "## Manual",
        "## Layout",
        "## Results on this machine",
    ):
        assert heading in readme, heading


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see `v41jax/engram/hashing.py`.", ["v41jax/engram/hashing.py"]),
        ("(`experiments/dspark/`), then", ["experiments/dspark/"]),
        ("`tests/**/test_lowering_*.py` and `experiments/*/README.md`", []),
        ("`experiments/.../README.md`", []),
        ("runs/dspark/drafters/dspark/x.json, runs/tiny, DIR", []),
        ("`loop_round_cost_b{B}_s{S}.json` in experiments/dspark/x_{B}.json", []),
        ("python experiments/dspark/run.py --quick", ["experiments/dspark/run.py"]),
    ],
)
def test_path_refs_precision(text, expected):
    assert path_refs(text) == expected


def test_resolution_flags_what_is_missing():
    assert module_problem(ROOT, "v41jax.engram.hashing") is None
    assert module_problem(ROOT, "v41jax.engram.hashing.ngram_hash_ids_np") is None
    assert module_problem(ROOT, "v41jax.engram.hashing.no_such_name") is not None
    assert module_problem(ROOT, "v41jax.nonexistent_package.module") is not None
    assert link_targets("[a](accelerators.md#gpu) [b](https://x.org) [c](#top)") == [
        "accelerators.md"
    ]
    assert path_refs("see docs/no_such_page.md") == ["docs/no_such_page.md"]
    assert not (ROOT / "docs" / "no_such_page.md").exists()
