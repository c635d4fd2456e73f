"""An Engram table parameter that stays in host memory or on disk: `HostRows`.

Rows are addressed by token ids alone, so decoding never needs the table on the device.
`HostRows` stands in the params tree where the table [R, C] would be. It is a pytree node
with no array leaves (the object itself is static data), so params holding it pass through
`jax.jit`, `nn.unbox`, `tree_map` and sharding trees unchanged, and the Engram layer reads
its rows through a host callback inside the compiled program:

    e[b, t] = concat_h source[flat_ids[b, t, h]]        float32 [B, T, H*C]

`source` is a `HostTable` (numpy, optionally FP8 with row or block scales), a `TableFile`
(memory-mapped, larger than RAM) or a numpy array. On the CPU backend the read is a native
XLA FFI call (`v41jax.kernels.host_gather`: no trip into Python, bitwise the same rows) for
every source it can address directly (numpy arrays, `HostTable`s, fully written
`TableFile`s); otherwise, and on GPU/TPU, a `jax.pure_callback`. The read's only input is the ids,
which a decode step computes from the tokens before block 0, so XLA is free to run the
host gather while the blocks before the first Engram layer compute (V4.1 overlaps the
prefetch with block 1); whether it overlaps is the runtime's choice, and the decode
benchmark (`python -m v41jax.bench host_decode`) measures the cost either way.

The table is read-only here: decoding and evaluation. Training with host tables gathers the
rows in the input pipeline instead (`v41jax.engram.training.host`), where the optimizer's
updates are ordered with the prefetch. The callback runs on one host: under a multi-device
mesh XLA brings the ids to one device for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.kernels import host_gather


class HostRows:
    """A read-only table [num_rows, dim] in host memory or a file, read by `lookup`.

    source: `HostTable`, `TableFile` or a numpy array [R, C] (any float dtype; rows are
    returned as float32). allow_native=False always reads by callback (benchmarks, tests).
    Hashable by identity: two HostRows are the same static value only if they are the same
    object, so a jitted function compiles once per table.
    """

    def __init__(self, source, allow_native: bool = True):
        self.source, self.allow_native = source, allow_native
        if isinstance(source, np.ndarray):
            if source.ndim != 2:
                raise ValueError(f"HostRows: table must be [R, C], got shape {source.shape}")
            self.num_rows, self.dim = source.shape
        elif hasattr(source, "table") and hasattr(source, "num_rows"):  # HostTable
            self.num_rows, self.dim = source.num_rows, source.table.shape[1]
        elif hasattr(source, "num_rows") and hasattr(source, "dim"):  # TableFile
            self.num_rows, self.dim = source.num_rows, source.dim
        else:
            raise TypeError(
                f"HostRows: source must be a HostTable, a TableFile or a numpy array, "
                f"got {type(source).__name__}"
            )

    def native(self) -> host_gather.NativeTable | None:
        """The source as the native gather reads it, or None (callback) where it cannot:
        not on CPU, turned off, a layout it does not read, or a lazy `TableFile` with rows
        never written (their values are computed on the host)."""
        if not self.allow_native or not host_gather.available():
            return None
        if not hasattr(self, "_native"):
            self._native = _native_form(self.source)
        return self._native

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.dim)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)  # what lookup returns; the storage may be narrower

    def read(self, flat_ids) -> np.ndarray:
        """ids int [...] -> float32 [..., C] on the host. Raises on ids outside [0, R)."""
        ids = np.asarray(flat_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"HostRows.read: ids must be integers, got {ids.dtype}")
        src = self.source
        if isinstance(src, np.ndarray):
            if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
                bad = ids.min() if ids.min() < 0 else ids.max()
                raise ValueError(f"HostRows.read: id {int(bad)} outside [0, {self.num_rows})")
            return np.take(src, ids, axis=0).astype(np.float32, copy=False)
        if hasattr(src, "table"):  # HostTable.gather concatenates the last axis's rows
            return src.gather(ids.reshape(-1, 1)).reshape(*ids.shape, self.dim)
        return src.gather(ids)

    def lookup(self, flat_ids_BxTxH: jax.Array) -> jax.Array:
        """e float32 [B, T, H*C] = the rows of flat ids [B, T, H], read on the host."""
        *lead, h = flat_ids_BxTxH.shape
        out = jax.ShapeDtypeStruct((*lead, h * self.dim), jnp.float32)

        def host_read(ids):
            ids = np.asarray(ids)
            return self.read(ids).reshape(*ids.shape[:-1], ids.shape[-1] * self.dim)

        native = self.native()
        if native is not None:
            return host_gather.gather(native, flat_ids_BxTxH).reshape(out.shape)
        # the rows are a pure function of the ids: a batched call reads the stacked ids
        return jax.pure_callback(host_read, out, flat_ids_BxTxH, vmap_method="expand_dims")

    def __repr__(self) -> str:
        return f"HostRows({type(self.source).__name__}, rows={self.num_rows}, dim={self.dim})"


jax.tree_util.register_static(HostRows)


def read_host_rows(refs: dict, flat_ids: dict) -> dict:
    """{layer: rows float32 [N, C]} for {layer: HostRows} and {layer: flat ids [B, T, H]}
    (N = B T H, row n is ids.ravel()[n]): natively where `HostRows.native` allows, the
    other layers' rows in ONE host callback, whose fixed cost (a trip into Python) is then
    paid once per forward, not once per layer."""
    native = {k: refs[k].native() for k in refs}
    rows = {k: host_gather.gather(t, flat_ids[k].reshape(-1)) for k, t in native.items() if t}
    layers = sorted(k for k in refs if k not in rows)
    if not layers:
        return rows
    out = tuple(jax.ShapeDtypeStruct((flat_ids[k].size, refs[k].dim), jnp.float32) for k in layers)

    def host_read(*ids):
        pairs = zip(layers, ids, strict=True)
        return tuple(refs[k].read(np.asarray(i).reshape(-1)) for k, i in pairs)

    got = jax.pure_callback(
        host_read, out, *(flat_ids[k] for k in layers), vmap_method="sequential"
    )
    return rows | dict(zip(layers, got, strict=True))


def _native_form(src) -> host_gather.NativeTable | None:
    if isinstance(src, np.ndarray):
        return host_gather.NativeTable.from_arrays(src)
    if hasattr(src, "table"):  # HostTable
        scale = src.block_exp if src.block_exp is not None else src.scale
        return host_gather.NativeTable.from_arrays(src.table, scale)
    if src.lazy and not _all_written(src.touched, src.num_rows):
        return None
    return host_gather.NativeTable.from_arrays(src.data, src.scale if src.fp8 else None)


def _all_written(bitmap: np.ndarray, num_rows: int) -> bool:
    """Every bit of rows [0, num_rows) set in a TableFile's touched bitmap."""
    full, tail = divmod(num_rows, 8)
    return bool(np.all(bitmap[:full] == 0xFF)) and (
        tail == 0 or (int(bitmap[full]) & ((1 << tail) - 1)) == (1 << tail) - 1
    )
