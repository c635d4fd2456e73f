"""From a `DataConfig` to packed, sharded, resumable batches.

`prepare_data` loads and splits the corpus, trains (or loads) the tokenizer on the training split,
tokenizes both splits into one flat stream each (every document followed by the eos; an imported
model's documents also start as its tokenizer starts a text, e.g. Llama's with BOS), and
builds the Engram compression table. Token arrays are cached in the cache folder, keyed by the
tokenizer and the split's content, so a warm start only reads two .npz files.

`BatchIterator` cuts a stream into windows of seq_len + 1 tokens with stride seq_len (every token
after the first is a target exactly once per epoch) and serves a shuffled global batch per step
as a pure function of the step, so its whole state is the step number. It reads only the rows
it serves, so the streams may be memmaps of a token file (`v41jax.data.token_files`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from v41jax.config import DataConfig
from v41jax.data.compression import CompressionTable, build_compression_table
from v41jax.data.corpus import (
    Document,
    atomic_write,
    load_documents,
    resolve_cache_dir,
    split_documents,
)
from v41jax.data.tokenizer import Tokenizer, load_or_train_tokenizer

_TOKENS_CACHE_VERSION = "tokens-v1"
_ENCODE_CHUNK_DOCS = 32  # documents per encode_batch call: granularity of the progress bar


@dataclass
class PreparedData:
    """Tokenized train/validation streams plus the tokenizer and its compression table.

    `*_tokens`: int32 [N], documents concatenated, each followed by `tokenizer.eos_id` (the eos
    belongs to its document) and, for a tokenizer whose texts start with a template's tokens
    (Llama's BOS), starting with them (`document_start`).
    `*_segments`: int32 [N], index of the document of each token
    (0, 0, ..., 1, 1, ...: non-decreasing, +1 at each document start).
    """

    tokenizer: Tokenizer
    compression: CompressionTable
    train_tokens: np.ndarray
    train_segments: np.ndarray
    val_tokens: np.ndarray
    val_segments: np.ndarray
    num_train_docs: int
    num_val_docs: int
    corpus_sha256: str = ""  # of the documents' names and texts (after max_documents)
    # `stream_sha256` of the train split when known without reading it (a token file's)
    train_sha256: str | None = None


def _docs_hash(docs: Sequence[Document]) -> str:
    h = hashlib.sha256(f"{len(docs)}\n".encode())
    for d in docs:
        for part in (d.name.encode("utf-8"), d.text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def stream_sha256(tokens: np.ndarray, segments: np.ndarray) -> str:
    """Identity of a split: sha256 of its tokens then its document index, both as int32 [N]
    (checkpoints record it, so a run resumes only on the data it trained on)."""
    h = hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(segments, dtype=np.int32).tobytes())
    return h.hexdigest()[:16]


def check_split_sizes(cfg: DataConfig, split: str, num_tokens: int, num_docs: int) -> None:
    """Raise unless `split` ("train" or "validation") holds one global batch of windows."""
    hint = "more documents (data.paths/max_documents)"
    if split == "validation":
        hint = "a larger data.val_fraction, more documents"
    windows = max(num_tokens - 1, 0) // cfg.seq_len
    if windows < cfg.global_batch_size:
        raise ValueError(
            f"the {split} split has {num_tokens} tokens in {num_docs} documents: "
            f"{windows} sequences of data.seq_len={cfg.seq_len}, fewer than one batch of "
            f"data.global_batch_size={cfg.global_batch_size}; use {hint}, or a smaller "
            "seq_len or global_batch_size"
        )


def _segments_from_lengths(doc_lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(doc_lengths), dtype=np.int32), doc_lengths)


def document_start(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids a stream puts before each document's text: the tokenizer's `document_prefix`
    (Llama's BOS), except v41jax's own (eos,), which the eos ending the document before already
    is (its streams are unchanged: document, eos, document, eos, ...)."""
    prefix = tokenizer.document_prefix
    return () if prefix == (tokenizer.eos_id,) else prefix


def _tokenize_docs(
    tokenizer: Tokenizer, docs: Sequence[Document], desc: str, show_progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens int32 [N], doc_lengths int64 [D]); lengths count each document's start
    (`document_start`) and eos."""
    pieces: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    start = np.array(document_start(tokenizer), dtype=np.int32)
    starts = range(0, len(docs), _ENCODE_CHUNK_DOCS)
    for s in tqdm(starts, desc=desc, unit="chunk", disable=not show_progress):
        for ids in tokenizer.encode_batch([d.text for d in docs[s : s + _ENCODE_CHUNK_DOCS]]):
            pieces.extend((start, np.asarray(ids, dtype=np.int32), eos))
    doc_lengths = np.array([len(p) for p in pieces[1::3]], dtype=np.int64) + start.size + 1
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return tokens, doc_lengths


def _load_or_tokenize(
    tokenizer: Tokenizer, docs: Sequence[Document], cache_dir: str, desc: str, show: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Cached `_tokenize_docs` -> (tokens int32 [N], segments int32 [N])."""
    # streams cached before documents had a start hold none: those with one get their own key
    start = document_start(tokenizer)
    framing = f":start={list(start)}" if start else ""
    key = hashlib.sha256(
        f"{_TOKENS_CACHE_VERSION}{framing}:{tokenizer.content_hash}:{_docs_hash(docs)}".encode()
    ).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokens-{key}.npz")
    if os.path.isfile(path):
        with np.load(path) as f:
            tokens, doc_lengths = f["tokens"], f["doc_lengths"]
        if len(doc_lengths) == len(docs) and doc_lengths.sum() == len(tokens):
            return tokens, _segments_from_lengths(doc_lengths)
        # A corrupt or foreign file under our key: fall through and rewrite it.
    tokens, doc_lengths = _tokenize_docs(tokenizer, docs, desc, show)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, tokens=tokens, doc_lengths=doc_lengths)

    atomic_write(path, write)
    return tokens, _segments_from_lengths(doc_lengths)


def prepare_data(
    cfg: DataConfig, *, show_progress: bool = False, tokenizer: Tokenizer | None = None
) -> PreparedData:
    """Load, split, tokenize and compress the corpus described by `cfg` (see module docstring).

    `cfg.max_documents > 0` keeps the first documents in name order before splitting.
    `tokenizer`: use this one (e.g. a run's, to fine-tune it on other text) instead of the BPE
    trained on these documents; its vocabulary size must be `cfg.vocab_size`.
    Raises if either split has fewer windows of seq_len + 1 tokens than one global batch.
    """
    if cfg.max_documents < 0:
        raise ValueError(f"data.max_documents={cfg.max_documents} must be >= 0 (0 = all)")
    for name in ("seq_len", "global_batch_size"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"data.{name}={getattr(cfg, name)} must be > 0")
    docs = load_documents(cfg.paths)
    if cfg.max_documents:
        docs = docs[: cfg.max_documents]
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    if tokenizer is None:
        tokenizer = load_or_train_tokenizer([d.text for d in train_docs], cfg.vocab_size, cache_dir)
    elif tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"the given tokenizer has {tokenizer.vocab_size} tokens, data.vocab_size="
            f"{cfg.vocab_size}"
        )
    train_tokens, train_segments = _load_or_tokenize(
        tokenizer, train_docs, cache_dir, "tokenize train", show_progress
    )
    val_tokens, val_segments = _load_or_tokenize(
        tokenizer, val_docs, cache_dir, "tokenize val", show_progress
    )
    check_split_sizes(cfg, "train", len(train_tokens), len(train_docs))
    check_split_sizes(cfg, "validation", len(val_tokens), len(val_docs))
    return PreparedData(
        tokenizer=tokenizer,
        compression=build_compression_table(tokenizer),
        train_tokens=train_tokens,
        train_segments=train_segments,
        val_tokens=val_tokens,
        val_segments=val_segments,
        num_train_docs=len(train_docs),
        num_val_docs=len(val_docs),
        corpus_sha256=_docs_hash(docs),
    )


def segment_ids_and_positions(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row document numbering of packed rows.

    `segments`: int [B, T], a document index per token (non-decreasing along T).
    Returns int32 [B, T] `segment_ids` (1-based document number within the row; 0 is left free
    for padding) and int32 [B, T] `positions` (offset from the start of its segment in the row).
    """
    b, t = segments.shape
    starts = np.ones((b, t), dtype=bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    idx = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    segment_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return segment_ids, (idx - segment_start).astype(np.int32)


class BatchIterator:
    """Deterministic, resumable, per-process batches of packed sequences.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1] for i < num_windows = (N-1)//seq_len;
    the last (N-1) % seq_len tokens of the stream (less than one sequence) are never targets.
    Epoch e visits the windows in the order of a permutation seeded by (seed, e) (identity when
    shuffle=False), batches_per_epoch = num_windows // global_batch_size; the last
    num_windows % global_batch_size windows of each epoch's order are left out of that epoch
    only. Since the order is reshuffled every epoch, no window is permanently excluded.
    This process gets rows [process_index*b, (process_index+1)*b) of each global batch,
    b = global_batch_size // process_count, and reads only those rows' tokens.

    `tokens`: int [N] (an array or a read-only memmap: never copied whole). `segments`: the
    document index int [N] of each token, as an array or any object with `.shape == (N,)` and
    integer-array indexing (a token file's `DocumentIndex`). `data_sha256`: the streams'
    `stream_sha256` when known (a token file's manifest); None hashes them on first `state()`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        segments: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
        *,
        data_sha256: str | None = None,
    ):
        tokens = np.asarray(tokens)  # a memmap stays a view of its file: nothing is read
        if not hasattr(segments, "shape"):
            segments = np.asarray(segments)
        if tokens.ndim != 1 or tokens.shape != segments.shape:
            raise ValueError(
                f"tokens and segments must be 1-D of equal length, got {tokens.shape} "
                f"and {segments.shape}"
            )
        if seq_len <= 0 or global_batch_size <= 0:
            raise ValueError(
                f"seq_len={seq_len} and global_batch_size={global_batch_size} must be > 0"
            )
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        if process_count <= 0 or not 0 <= process_index < process_count:
            raise ValueError(
                f"need 0 <= process_index < process_count, got {process_index} and {process_count}"
            )
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"process_count={process_count}"
            )
        self.tokens, self.segments = tokens, segments
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.process_index, self.process_count, self.shuffle = process_index, process_count, shuffle
        self.per_process_batch_size = global_batch_size // process_count
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        if self.num_windows < global_batch_size:
            raise ValueError(
                f"{len(tokens)} tokens give {self.num_windows} sequences of seq_len={seq_len}, "
                f"fewer than one global batch of {global_batch_size}"
            )
        self.batches_per_epoch = self.num_windows // global_batch_size
        self.step = 0
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, order) of the last epoch used
        self._data_hash = data_sha256

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(self.num_windows))
        return self._perm[1]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's slice of global batch `step` (a pure function of `step`).

        Returns `inputs`, `targets`, `segment_ids`, `positions`: int32 [b, T]; `loss_mask`:
        float32 [b, T] (all ones: every target is a real token). T = seq_len,
        b = global_batch_size // process_count. See `segment_ids_and_positions`.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, k = divmod(int(step), self.batches_per_epoch)
        b = self.per_process_batch_size
        first = k * self.global_batch_size + self.process_index * b
        windows = self._order(epoch)[first : first + b]
        idx = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        window_tokens = self.tokens[idx].astype(np.int32, copy=False)
        segment_ids, positions = segment_ids_and_positions(self.segments[idx[:, :-1]])
        return {
            "inputs": window_tokens[:, :-1],
            "targets": window_tokens[:, 1:],
            "segment_ids": segment_ids,
            "positions": positions,
            "loss_mask": np.ones((b, self.seq_len), dtype=np.float32),
        }

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def _fingerprint(self) -> dict[str, Any]:
        if self._data_hash is None:
            self._data_hash = stream_sha256(self.tokens, self.segments)
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_windows": self.num_windows,
            "shuffle": self.shuffle,
            "data_sha256": self._data_hash,
        }

    def state(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: the step plus fields that identify the data."""
        return {"step": self.step, **self._fingerprint()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()`; raises if it was taken on different data or settings."""
        mine = self._fingerprint()
        missing = sorted({"step", *mine} - set(state))
        if missing:
            raise ValueError(f"iterator state is missing {missing}; got keys {sorted(state)}")
        diffs = [
            f"{k}: checkpoint {state[k]!r} != now {v!r}" for k, v in mine.items() if state[k] != v
        ]
        if diffs:
            raise ValueError(
                "the checkpointed data iterator does not match this data (did the corpus, "
                "tokenizer or data config change?): " + "; ".join(diffs)
            )
        step = state["step"]
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"iterator state step={step!r} must be an int >= 0")
        self.step = int(step)


def eval_batches(
    tokens: np.ndarray,
    segments: np.ndarray,
    seq_len: int,
    global_batch_size: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` batches of the stream in order (no shuffling): a fixed
    validation set. Same dict format as `BatchIterator.batch_at`."""
    if num_batches <= 0 or seq_len <= 0 or global_batch_size <= 0:
        raise ValueError(
            f"num_batches={num_batches}, seq_len={seq_len} and "
            f"global_batch_size={global_batch_size} must all be > 0"
        )
    windows = max(len(tokens) - 1, 0) // seq_len
    possible = windows // global_batch_size
    if possible < num_batches:
        raise ValueError(
            f"validation data has {len(tokens)} tokens = {windows} sequences of seq_len={seq_len}: "
            f"at most {possible} batches of {global_batch_size}, but {num_batches} were requested"
        )
    it = BatchIterator(
        tokens,
        segments,
        seq_len,
        global_batch_size,
        seed=0,
        process_index=process_index,
        process_count=process_count,
        shuffle=False,
    )
    return [it.batch_at(s) for s in range(num_batches)]
