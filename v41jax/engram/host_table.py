"""Engram tables in host memory, gathered on the host ahead of the step.

The rows a token needs depend only on its token ids (deterministic addressing), so they can
be gathered by the input pipeline, in host memory and in a background thread, before the
accelerator needs them: the table never occupies device memory, and the device receives
only the H rows per token it reads (V4.1 keeps inference tables in host memory this way,
prefetching during block 1). `HostTable.gather` is that host-side gather:

    e[n] = concat_h table[ids[n, h]] (* scale[ids[n, h]] for FP8 rows)   -> [N, H*E] float32

It splits the ids over `threads` workers (numpy releases the GIL inside `take`), each
gathering into its slice of one preallocated output, which on this CPU moves rows at about
twice the bytes/s of XLA's gather (`python -m v41jax.bench engram`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

FP8_NUMPY = np.dtype(ml_dtypes.float8_e4m3fn)


class HostTable:
    """A flat Engram table [R, E] in host memory (float32, bfloat16, or fp8 with row scale)."""

    def __init__(
        self,
        table_RxE: np.ndarray,
        row_scale_R: np.ndarray | None = None,
        threads: int | None = None,
    ):
        table = np.asarray(table_RxE)
        if table.ndim != 2:
            raise ValueError(f"HostTable: table must be [R, E], got shape {table.shape}")
        if (table.dtype == FP8_NUMPY) != (row_scale_R is not None):
            raise ValueError(
                f"HostTable: a float8_e4m3fn table needs a row scale and only it takes one "
                f"(table dtype {table.dtype}, scale given: {row_scale_R is not None})"
            )
        if row_scale_R is not None and np.shape(row_scale_R) != (table.shape[0],):
            raise ValueError(
                f"HostTable: row scale shape {np.shape(row_scale_R)} != ({table.shape[0]},)"
            )
        self.table = table
        self.scale = None if row_scale_R is None else np.asarray(row_scale_R, np.float32)
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def _gather_into(self, out_MxE: np.ndarray, ids_M: np.ndarray) -> None:
        rows = np.take(self.table, ids_M, axis=0)
        if self.scale is not None:
            np.multiply(rows, self.scale[ids_M, None], out=out_MxE, dtype=np.float32)
        else:
            out_MxE[...] = rows

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """ids int [..., H] (flat row ids) -> float32 [..., H*E]. Raises on ids outside
        [0, R) naming the value (host data can always be checked)."""
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"HostTable.gather: ids must be integers, got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"HostTable.gather: id {int(bad)} outside [0, {self.num_rows})")
        flat = ids.reshape(-1)
        out = np.empty((flat.size, self.table.shape[1]), np.float32)
        if self._pool is None or flat.size < 4096:
            self._gather_into(out, flat)
        else:
            bounds = np.linspace(0, flat.size, self.threads + 1).astype(int)
            jobs = [
                self._pool.submit(self._gather_into, out[a:b], flat[a:b])
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
            for job in jobs:
                job.result()
        return out.reshape(*ids.shape[:-1], ids.shape[-1] * self.table.shape[1])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
