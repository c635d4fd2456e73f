"""Host-side batch preparation: Engram hash ids computed ahead of the step, in a thread.

Engram's rows depend only on the token ids (deterministic addressing), so the ids of step
s + 1 are hashed on the host while the device runs step s; the model never waits for them.
The batch of step s is a pure function of s, so prefetching changes nothing the checkpoint
records: the iterator's state still counts the batches the loop has consumed.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from v41jax.config import ModelConfig
from v41jax.data import BatchIterator, CompressionTable, compress_ids
from v41jax.engram import ngram_hash_ids_np
from v41jax.model import engram_ids_key

BASE_BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def batch_keys(cfg: ModelConfig) -> tuple[str, ...]:
    """Keys of a training batch: the base keys plus one hash-id array per Engram layer."""
    return BASE_BATCH_KEYS + tuple(engram_ids_key(layer) for layer in cfg.engram.layer_ids)


def add_engram_ids(
    batch: dict[str, np.ndarray], compression: CompressionTable, cfg: ModelConfig
) -> dict[str, np.ndarray]:
    """Add `engram_ids_<layer>`: int32 [b, T, (max_n - 1) * heads] local hash ids per layer.

    The n-gram context restarts at document starts (`segment_ids`) when
    `cfg.engram.reset_at_segments`, as if each document began at its first token.
    """
    engram = cfg.engram
    if not engram.enabled:
        return batch
    compressed = compress_ids(batch["inputs"], compression)
    segments = batch["segment_ids"] if engram.reset_at_segments else None
    out = dict(batch)
    for layer in engram.layer_ids:
        ids = ngram_hash_ids_np(compressed, layer, engram, segment_ids=segments)
        out[engram_ids_key(layer)] = ids.astype(np.int32)
    return out


class PrefetchingBatches:
    """`next()` returns the prepared batch of the iterator's current step and advances it;
    the next `depth` batches are prepared in a background thread meanwhile."""

    def __init__(self, iterator: BatchIterator, prepare, depth: int = 2):
        self.iterator = iterator
        self.prepare = prepare
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches")
        self._pending: dict[int, Future] = {}

    def _schedule(self, step: int) -> None:
        if step not in self._pending:
            self._pending[step] = self._pool.submit(
                lambda: self.prepare(self.iterator.batch_at(step))
            )

    def __next__(self) -> dict[str, np.ndarray]:
        step = self.iterator.step
        for s in range(step, step + self.depth + 1):
            self._schedule(s)
        batch = self._pending.pop(step).result()
        self.iterator.step = step + 1
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
