"""Token files: a corpus tokenized once (`python -m v41jax prepare-data`), read by offset.

`write_token_dir(cfg, DIR)` runs the in-memory pipeline (`prepare_data`: load, split, train or
load the tokenizer, tokenize) once and writes what training needs into DIR:

    manifest.json              format version, dtype, token and document counts, the corpus,
                               tokenizer and stream hashes, the data config it was made with
    train_tokens.npy           uint16 [N] (vocab_size <= 65,536), else uint32: the documents
    validation_tokens.npy      concatenated, each followed by the eos (and, for an imported
                               model's tokenizer, started by its template: `document_start`)
    train_doc_offsets.npy      int64 [D + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
    validation_doc_offsets.npy (segment ids and positions are rebuilt from them per batch)
    tokenizer.json             the BPE tokenizer
    compression.npz            the Engram compression table (when the config uses Engram)

`load_token_dir(cfg)` (training with `data.token_dir=DIR`) opens the arrays as read-only
memmaps and returns a `PreparedData` whose streams are those memmaps: `BatchIterator` reads
only the rows of this process's share of batch `step`, so no process holds the corpus in RAM
(the OS page cache keeps what is read often). The per-token document index is not stored:
`DocumentIndex` finds a token's document by binary search in the offsets. Batches, their
order and the iterator's checkpointed fingerprint equal the in-memory path's for the same text
(`tests/data/test_data_token_files.py`), so the two paths train identically.

Why .npy memmaps and not ArrayRecord or grain: the data is one flat stream of fixed-width
ids, and a batch is a set of windows at known offsets, so random access is an index
computation on a memmap, zero-copy, readable by any numpy on any host, with no dependency
beyond numpy. ArrayRecord stores variable-length records (documents), which would need a
window-to-record index and a decode per read; grain's value is its sampler, worker processes
and checkpointable iterator, which `BatchIterator` already is (state = the step). Neither
`grain` nor `array-record` is installed here (both are on PyPI: grain 0.2.18, array-record
0.8.6); a grain `RandomAccessDataSource` over these files would be a thin wrapper if wanted.

Preparation holds the corpus's tokens in RAM once (int32, as `prepare_data` does); training
never does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from v41jax.config import Config, DataConfig
from v41jax.data.compression import CompressionTable, build_compression_table
from v41jax.data.pipeline import (
    PreparedData,
    check_split_sizes,
    document_start,
    prepare_data,
    stream_sha256,
)
from v41jax.data.tokenizer import Tokenizer

FORMAT = "v41jax-token-dir"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
# The DataConfig fields that decide the files' content; a training config must agree on them.
# seq_len and global_batch_size only decide how the stream is cut into windows at load time,
# so one token dir serves any of them; cache_dir and token_dir say where things are.
CONTENT_FIELDS = ("paths", "max_documents", "val_fraction", "seed", "vocab_size")
_PREPARE_HINT = "python -m v41jax prepare-data --config C --out DIR"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids in [0, vocab_size): uint16 or uint32."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32] for a token file")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class DocumentIndex:
    """The document index int32 [N] of a split's tokens, computed on read from the document
    offsets int64 [D + 1] (memmap) instead of stored: token i belongs to document
    searchsorted(offsets, i, "right") - 1. Indexes like the [N] array of `prepare_data`."""

    ndim = 1

    def __init__(self, offsets: np.ndarray):
        self.offsets = offsets
        self.shape = (int(offsets[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        idx = np.asarray(idx)
        n = self.shape[0]
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"token index [{idx.min()}, {idx.max()}] outside [0, {n})")
        return (np.searchsorted(self.offsets, idx, side="right") - 1).astype(np.int32)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """All of it, [N] (for tools that want the whole array; training never calls this)."""
        out = np.repeat(np.arange(len(self.offsets) - 1, dtype=np.int32), np.diff(self.offsets))
        return out if dtype is None else out.astype(dtype)


def _content(data: DataConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(data).items()}


def write_token_dir(
    cfg: Config, out: str, *, tokenizer: Tokenizer | None = None, show_progress: bool = False
) -> dict:
    """Tokenize `cfg.data`'s corpus (see `prepare_data`; `tokenizer` as there) into the new
    folder `out` (see the module docstring); returns the manifest. `out` must not exist or be
    empty; the files are written beside it and renamed into place at the end, so `out` is
    either complete or absent."""
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out!r} exists and is not an empty folder; choose another")
    data_cfg = dataclasses.replace(cfg.data, token_dir="")
    data = prepare_data(data_cfg, show_progress=show_progress, tokenizer=tokenizer)
    dtype = token_dtype(data.tokenizer.vocab_size)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.partial-")
    try:
        splits = {}
        for split, tokens, segments, num_docs in (
            ("train", data.train_tokens, data.train_segments, data.num_train_docs),
            ("validation", data.val_tokens, data.val_segments, data.num_val_docs),
        ):
            if tokens.size and (tokens.min() < 0 or tokens.max() >= data.tokenizer.vocab_size):
                raise ValueError(  # never cast an out-of-range id into the narrow dtype
                    f"{split} token ids [{tokens.min()}, {tokens.max()}] outside the "
                    f"tokenizer's [0, {data.tokenizer.vocab_size})"
                )
            lengths = np.bincount(segments, minlength=num_docs).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            np.save(os.path.join(tmp, f"{split}_tokens.npy"), tokens.astype(dtype))
            np.save(os.path.join(tmp, f"{split}_doc_offsets.npy"), offsets)
            splits[split] = {
                "tokens": int(tokens.size),
                "documents": int(num_docs),
                "stream_sha256": stream_sha256(tokens, segments),
            }
        data.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        compression = None
        if cfg.model.engram.enabled:
            compression = "compression.npz"
            data.compression.save(os.path.join(tmp, compression))
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": data.tokenizer.vocab_size,
            "eos_id": data.tokenizer.eos_id,
            "tokenizer_sha256": data.tokenizer.content_hash,
            "document_start": list(document_start(data.tokenizer)),
            "corpus_sha256": data.corpus_sha256,
            "compression": compression,
            "splits": splits,
            "data": _content(data_cfg),
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):  # mkdtemp/mkstemp make them private; other hosts read them
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above): the rename needs the name free
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"data.token_dir={where}: {what}; recreate it with `{_PREPARE_HINT}`")


def read_manifest(token_dir: str) -> dict:
    """The manifest of `token_dir`; raises naming the folder if it is missing or not ours."""
    if not os.path.isdir(token_dir):
        raise FileNotFoundError(
            f"data.token_dir={token_dir} does not exist; create it with `{_PREPARE_HINT}`"
        )
    path = os.path.join(token_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.token_dir={token_dir} has no {MANIFEST} (not a prepare-data folder, or its "
            f"preparation was interrupted); create it with `{_PREPARE_HINT}`"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(token_dir, f"{MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _fail(token_dir, f"{MANIFEST} is not a {FORMAT} manifest")
    if (version := manifest.get("version")) != FORMAT_VERSION:
        raise _fail(token_dir, f"format version {version!r}; this code reads {FORMAT_VERSION}")
    missing = sorted({"dtype", "vocab_size", "tokenizer_sha256", "splits", "data"} - {*manifest})
    if missing or any(s not in manifest["splits"] for s in SPLITS):
        raise _fail(token_dir, f"{MANIFEST} lacks {missing or list(SPLITS)}")
    return manifest


def _open(token_dir: str, name: str, dtype: str, shape: tuple[int]) -> np.ndarray:
    path = os.path.join(token_dir, name)
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:  # missing, truncated, not an .npy
        raise _fail(token_dir, f"{name} is unreadable ({e})") from None
    if array.dtype != np.dtype(dtype) or array.shape != shape:
        raise _fail(
            token_dir,
            f"{name} is {array.dtype} {array.shape}, the manifest says {dtype} {shape}",
        )
    return array


def load_token_dir(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> PreparedData:
    """`cfg.token_dir`'s splits as memmaps (see the module docstring).

    `tokenizer`: the one the run must use (a resumed run's, a fine-tuning source's); it must be
    the folder's. Raises FileNotFoundError for a missing folder or manifest, ValueError naming
    the field for a manifest that disagrees with `cfg` (`CONTENT_FIELDS`, the tokenizer) or
    files that disagree with the manifest, and when a split holds less than one batch.
    """
    where = cfg.token_dir
    manifest = read_manifest(where)
    prepared, now = manifest["data"], _content(cfg)
    diffs = [
        f"data.{k}={now[k]!r} but it was prepared with data.{k}={prepared.get(k)!r}"
        for k in CONTENT_FIELDS
        if prepared.get(k) != now[k]
    ]
    if diffs:
        raise ValueError(
            f"data.token_dir={where} does not match the config: {'; '.join(diffs)}. Set the "
            f"same values, or prepare a folder for this config with `{_PREPARE_HINT}`"
        )
    try:
        stored = Tokenizer.load(os.path.join(where, "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise _fail(where, f"tokenizer.json is unreadable ({e})") from None
    if stored.content_hash != manifest["tokenizer_sha256"]:
        raise _fail(where, "tokenizer.json is not the tokenizer its tokens were made with")
    # Folders written before documents were started with the template hold none ([]).
    framed, expected = manifest.get("document_start", []), list(document_start(stored))
    if framed != expected:
        raise _fail(
            where,
            f"its documents start with ids {framed}, but its tokenizer starts a text with "
            f"{expected} (a folder prepared before imported models' documents were framed "
            "by their tokenizer's template): its token streams are not the model's",
        )
    if tokenizer is not None and tokenizer.content_hash != stored.content_hash:
        raise ValueError(
            f"data.token_dir={where} was tokenized with tokenizer "
            f"{stored.content_hash[:12]}, but this run uses tokenizer "
            f"{tokenizer.content_hash[:12]} (a resumed run's or train.init_from's); prepare "
            "the folder with that tokenizer: prepare-data --tokenizer RUN/tokenizer.json"
        )
    streams = {}
    for split in SPLITS:
        info = manifest["splits"][split]
        tokens = _open(where, f"{split}_tokens.npy", manifest["dtype"], (info["tokens"],))
        offsets = _open(where, f"{split}_doc_offsets.npy", "int64", (info["documents"] + 1,))
        if info["documents"] < 1 or offsets[0] != 0 or offsets[-1] != info["tokens"]:
            raise _fail(where, f"{split}_doc_offsets.npy does not span its {info['tokens']} tokens")
        check_split_sizes(cfg, split, info["tokens"], info["documents"])
        streams[split] = (tokens, DocumentIndex(offsets), info)
    compression = manifest.get("compression")
    if compression:
        try:
            table = CompressionTable.load(os.path.join(where, compression))
        except (OSError, ValueError, KeyError) as e:
            raise _fail(where, f"{compression} is unreadable ({e})") from None
    else:  # prepared for a config without Engram: the table is a function of the tokenizer
        table = build_compression_table(stored)
    (train_tokens, train_docs, train), (val_tokens, val_docs, val) = streams.values()
    return PreparedData(
        tokenizer=stored,
        compression=table,
        train_tokens=train_tokens,
        train_segments=train_docs,
        val_tokens=val_tokens,
        val_segments=val_docs,
        num_train_docs=train["documents"],
        num_val_docs=val["documents"],
        corpus_sha256=manifest.get("corpus_sha256", ""),
        train_sha256=train.get("stream_sha256"),
    )


def load_data(
    cfg: DataConfig, *, show_progress: bool = False, tokenizer: Tokenizer | None = None
) -> PreparedData:
    """The training data `cfg` names: its token dir when `cfg.token_dir` is set, else the
    corpus tokenized in memory (`prepare_data`)."""
    if cfg.token_dir:
        return load_token_dir(cfg, tokenizer=tokenizer)
    return prepare_data(cfg, show_progress=show_progress, tokenizer=tokenizer)
