"""Engram tables in host memory, gathered on the host ahead of the step.

The rows a token needs depend only on its token ids (deterministic addressing), so they can
be gathered by the input pipeline, in host memory and in a background thread, before the
accelerator needs them: the table never occupies device memory, and the device receives
only the H rows per token it reads (V4.1 keeps inference tables in host memory this way,
prefetching during block 1). `HostTable.gather` is that host-side gather:

    e[n] = concat_h table[ids[n, h]] (* scale[ids[n, h]] for FP8 rows)   -> [N, H*E] float32

(FP8 rows in V4.1's block format are scaled per block of 32 by 2^(e - 127), bit for bit as
`fp8.dequantize_blocks`.)

It splits the ids over `threads` workers (numpy releases the GIL inside `take`), each
gathering into its slice of one preallocated output, which on this CPU moves rows at about
twice the bytes/s of XLA's gather (`python -m v41jax.bench engram`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from v41jax.engram import fp8

FP8_NUMPY = fp8.FP8_NUMPY


def _check_block_exp(exp_RxB: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    rows, emb = shape
    nb = exp_RxB.shape[1] if exp_RxB.ndim == 2 else 0
    if exp_RxB.shape != (rows, nb) or nb == 0 or emb % nb:
        raise ValueError(
            f"HostTable: block exponents shape {exp_RxB.shape} must be ({rows}, E // block) "
            f"for a block dividing E={emb}"
        )
    if np.any(exp_RxB == 255):
        bad = np.argwhere(exp_RxB == 255)[0].tolist()
        raise ValueError(f"HostTable: block exponent 255 (UE8M0 NaN) at [row, block] {bad}")
    return exp_RxB


class HostTable:
    """A flat Engram table [R, E] in host memory: float32, bfloat16, or fp8 with either a
    float32 row scale [R] or (V4.1's block format, `fp8.quantize_blocks_np`) uint8 UE8M0
    block exponents [R, E // block]."""

    def __init__(
        self,
        table_RxE: np.ndarray,
        scale: np.ndarray | None = None,
        threads: int | None = None,
    ):
        table = np.asarray(table_RxE)
        if table.ndim != 2:
            raise ValueError(f"HostTable: table must be [R, E], got shape {table.shape}")
        if (table.dtype == FP8_NUMPY) != (scale is not None):
            raise ValueError(
                f"HostTable: a float8_e4m3fn table needs a row scale or block exponents and "
                f"only it takes one (table dtype {table.dtype}, scale given: {scale is not None})"
            )
        self.block_exp = None
        self.scale = None
        if scale is not None and np.asarray(scale).dtype == np.uint8:
            self.block_exp = _check_block_exp(np.asarray(scale), table.shape)
        elif scale is not None:
            if np.shape(scale) != (table.shape[0],):
                raise ValueError(
                    f"HostTable: row scale shape {np.shape(scale)} != ({table.shape[0]},)"
                )
            self.scale = np.asarray(scale, np.float32)
        self.table = table
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def _gather_into(self, out_MxE: np.ndarray, ids_M: np.ndarray) -> None:
        rows = np.take(self.table, ids_M, axis=0)
        if self.block_exp is not None:  # the same float32 products as fp8.dequantize_blocks
            scale_MxB = fp8.block_scales_np(np.take(self.block_exp, ids_M, axis=0))
            shape = (*scale_MxB.shape, self.table.shape[1] // self.block_exp.shape[1])
            out = out_MxE.reshape(shape)  # a view: out_MxE is a contiguous slice
            np.multiply(rows.reshape(shape), scale_MxB[..., None], out=out, dtype=np.float32)
        elif self.scale is not None:
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
