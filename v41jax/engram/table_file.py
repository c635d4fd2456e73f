"""Engram tables in a file: memory-mapped, row-gathered, far larger than RAM.

Rows are addressed by token ids alone, so a table need not be in device or even host memory.
`TableFile` keeps one flat table [R, E] in a directory: `header.json` (version, rows, dim,
dtype, lazy, init recipe), `data.bin` (raw row-major [R, E] float32 / bfloat16 /
float8_e4m3fn), `scale.bin` (float32 [R] row scales, fp8 only: the `engram.fp8` format),
`touched.bin` and `dirty.bin` (bitmaps of rows holding stored values, lazy tables only, and
of rows written since the last snapshot) and `log/` (snapshot segments).

numpy.memmap, not tensorstore (installed as a flax/orbax dependency): a step gathers a few
thousand rows of 0.25-1 KiB at random; through a memmap that is one `np.take` (which frees
the GIL, so threads overlap page faults) on pages the OS cache keeps while hot. Tensorstore
adds async reads and chunk bookkeeping for features (chunks, compression, remote stores) a
local table does not use. The map is advised MADV_RANDOM: no readahead around a fault.

Init: element (r, e) is `init_std * N(0, 1)` from a counter-based generator (SplitMix64 of
(seed, r * ceil(E/2) + e // 2), Box-Muller), so a row's initial value depends on (seed, row
id) only: not on chunk sizes, creation order or `lazy`. Default `lazy=True`: `data.bin` is
created sparse (ftruncate) and an untouched row is generated on read; a row is stored, and
its touched bit set, when first written: creation costs no time or disk whatever R is, and
gathers never write. `lazy=False` writes every row up front (to ship a materialised file).
The generator is float32 numpy: bitwise reproducible for one numpy build on one CPU.

Checkpoints are a dirty-row log, never a second copy of the table: `snapshot(step)` appends
a segment of the ids and stored bytes (and scales) of the rows written since the previous
snapshot, streamed to `log/.tmp`, fsynced, CRC32-checked and renamed (atomic), so a process
killed mid-write leaves only the ignored temp file. The table at step s is the init plus the
segments up to s replayed in order; `restore_table_file` writes it to a new lazy table,
touching only rows ever updated. `data.bin` is the working copy, updated in place: after a
crash, resume from a restored snapshot (writes since the last one are not durable). Restore
needs every segment since creation. One writer at a time (nothing here is locked).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

VERSION = 1
_NAMES = ("float32", "bfloat16", "float8_e4m3fn")
DTYPES = {n: np.dtype(getattr(ml_dtypes, n, n)) for n in _NAMES}
FP8_MAX = 448.0
_SEG = struct.Struct("<8sIIqqqqI")  # magic, version, has_scale, step, count, dim, itemsize, crc
_MAGIC = b"V41TSEG1"
_U = np.uint64


def init_rows(ids: np.ndarray, dim: int, seed: int, init_std: float) -> np.ndarray:
    """float32 [n, dim]: the initial value of rows `ids` (a function of (seed, id) only);
    init_std 0 (a zero table, e.g. an optimizer state) skips the generator."""
    if init_std == 0:
        return np.zeros((np.size(ids), dim), np.float32)
    ids = np.asarray(ids, np.int64).reshape(-1)
    half = (dim + 1) // 2
    x = ids.astype(_U)[:, None] * _U(half) + np.arange(half, dtype=_U)[None, :]
    key = (int(seed) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x *= _U(0x9E3779B97F4A7C15)
    x += _U(key)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):  # SplitMix64
        x ^= x >> _U(shift)
        x *= _U(mult)
    x ^= x >> _U(31)
    u1 = ((x >> _U(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    theta = (x & _U(0xFFFFFF)).astype(np.float32) * np.float32(2 * np.pi * 2.0**-24)
    r = np.sqrt(np.float32(-2.0) * np.log(u1)) * np.float32(init_std)
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)], axis=1)[:, :dim]


def quantize_rows_np(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float rows [n, E] -> (float8_e4m3fn [n, E], float32 scale [n]): `engram.fp8`'s format,
    s = max|row| / 448 (1 for an all-zero row)."""
    rows = np.asarray(rows, np.float32)
    amax = np.max(np.abs(rows), axis=-1)
    # amax * (1/448), not amax / 448: XLA folds the division so, and this matches it bitwise
    scale = np.where(amax > 0, amax * np.float32(1 / FP8_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(rows / scale[:, None], -FP8_MAX, FP8_MAX).astype(DTYPES["float8_e4m3fn"])
    return q, scale


def _encode(rows: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
    if dtype == DTYPES["float8_e4m3fn"]:
        return quantize_rows_np(rows)
    return np.asarray(rows).astype(dtype), None


def _bits(bitmap: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return (bitmap[ids >> 3] >> (ids & 7).astype(np.uint8)) & np.uint8(1)


def _set_bits(bitmap: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_or.at(bitmap, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_table_file(
    path: str,
    rows: int,
    dim: int,
    dtype: str = "float32",
    *,
    seed: int = 0,
    init_std: float = 0.02,
    lazy: bool = True,
    chunk_rows: int = 1 << 16,
    threads: int | None = None,
    progress: bool = True,
) -> TableFile:
    """Create the table directory `path` (must not exist) and open it read-write."""
    if dtype not in DTYPES:
        raise ValueError(f"create_table_file: dtype {dtype!r} not in {sorted(DTYPES)}")
    if int(rows) < 1 or int(dim) < 1 or int(chunk_rows) < 1:
        raise ValueError(f"create_table_file: rows={rows}, dim={dim}, chunk_rows={chunk_rows}")
    if os.path.exists(path):
        raise FileExistsError(f"create_table_file: {path} already exists")
    rows, dim, np_dtype = int(rows), int(dim), DTYPES[dtype]
    init = {"kind": "normal", "std": float(init_std), "seed": int(seed)}
    header = dict(version=VERSION, rows=rows, dim=dim, dtype=dtype, lazy=bool(lazy), init=init)
    tmp = path.rstrip("/") + ".creating"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "log"))
    nbytes = rows * dim * np_dtype.itemsize
    fp8 = dtype == "float8_e4m3fn"
    _sized(tmp, "dirty.bin", -(-rows // 8))  # sparse: zero bits (and holes) cost no disk
    if lazy:
        _sized(tmp, "touched.bin", -(-rows // 8))
        _sized(tmp, "data.bin", nbytes)
        _sized(tmp, "scale.bin", rows * 4) if fp8 else None
    else:
        make = lambda a: _encode(  # noqa: E731
            init_rows(np.arange(a, min(a + chunk_rows, rows)), dim, seed, init_std), np_dtype
        )
        workers, starts = max(1, threads or os.cpu_count() or 1), range(0, rows, chunk_rows)
        bar = tqdm(total=nbytes, unit="B", unit_scale=True, desc="init", disable=not progress)
        with (
            open(_sized(tmp, "data.bin"), "wb") as fd,
            open(_sized(tmp, "scale.bin") if fp8 else os.devnull, "wb") as fs,
            ThreadPoolExecutor(workers) as pool,
            bar,
        ):
            for i in range(0, len(starts), workers):  # `workers` chunks at a time, in order
                for data, scale in pool.map(make, starts[i : i + workers]):
                    fd.write(data.tobytes())
                    fs.write(b"" if scale is None else scale.tobytes())
                    bar.update(data.nbytes)
    with open(os.path.join(tmp, "header.json"), "w") as f:
        json.dump(header, f, indent=1)
    os.rename(tmp, path)
    return TableFile(path, threads=threads)


def _sized(directory: str, name: str, size: int = 0) -> str:
    p = os.path.join(directory, name)
    with open(p, "wb") as f:
        f.truncate(size)
    return p


class TableFile:
    """An Engram table [R, E] in a file directory (see the module docstring)."""

    def __init__(self, path: str, mode: str = "r+", threads: int | None = None):
        if mode not in ("r", "r+"):
            raise ValueError(f"TableFile: mode must be 'r' or 'r+', got {mode!r}")
        head = os.path.join(path, "header.json")
        if not os.path.isfile(head):
            raise FileNotFoundError(f"TableFile: no table at {path} ({head} not found)")
        with open(head) as f:
            self.header = h = json.load(f)
        if h.get("version") != VERSION or h.get("dtype") not in DTYPES:
            raise ValueError(f"TableFile: {head}: unsupported version/dtype {h}")
        self.path, self.mode = path, mode
        self.num_rows, self.dim, self.dtype = h["rows"], h["dim"], DTYPES[h["dtype"]]
        self.lazy, self.fp8 = h["lazy"], h["dtype"] == "float8_e4m3fn"
        nbits = -(-self.num_rows // 8)
        shape = (self.num_rows, self.dim)
        self.data = self._map("data.bin", self.dtype, shape, True)
        self.scale = self._map("scale.bin", np.float32, (self.num_rows,), self.fp8)
        self.touched = self._map("touched.bin", np.uint8, (nbits,), self.lazy)
        self.dirty = self._map("dirty.bin", np.uint8, (nbits,), True)
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def _map(self, name: str, dtype, shape: tuple[int, ...], needed: bool):
        if not needed:
            return None
        p = os.path.join(self.path, name)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"TableFile: {p} missing (header: {self.header})")
        want, size = int(np.prod(shape)) * np.dtype(dtype).itemsize, os.path.getsize(p)
        if size != want:
            raise ValueError(
                f"TableFile: {p} has {size} bytes but the header's shape {list(shape)} "
                f"of {np.dtype(dtype).name} needs {want}"
            )
        mm = np.memmap(p, dtype=dtype, mode=self.mode, shape=shape)
        if name == "data.bin" and hasattr(mm, "_mmap") and hasattr(mmap, "MADV_RANDOM"):
            mm._mmap.madvise(mmap.MADV_RANDOM)  # random rows: no readahead around a fault
        return mm

    def _check_ids(self, ids, what: str) -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"TableFile.{what}: ids must be integers, got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"TableFile.{what}: id {int(bad)} outside [0, {self.num_rows})")
        return ids.astype(np.int64, copy=False)

    def _read_into(self, out_MxE: np.ndarray, ids_M: np.ndarray) -> None:
        rows = np.take(self.data, ids_M, axis=0)
        if self.fp8:
            np.multiply(rows, np.take(self.scale, ids_M)[:, None], out=out_MxE, dtype=np.float32)
        else:
            out_MxE[...] = rows
        fresh = np.flatnonzero(_bits(self.touched, ids_M) == 0) if self.lazy else ()
        if len(fresh):  # untouched: the init, rounded as storing it would round it
            i = self.header["init"]
            q, s = _encode(init_rows(ids_M[fresh], self.dim, i["seed"], i["std"]), self.dtype)
            out_MxE[fresh] = q.astype(np.float32) * (1 if s is None else s[:, None])

    def gather(self, ids) -> np.ndarray:
        """ids int, any shape -> float32 [*ids.shape, E] (dequantised; an untouched lazy row
        is its deterministic init). Raises on ids outside [0, R) naming the value."""
        ids = self._check_ids(ids, "gather")
        flat = ids.reshape(-1)
        out = np.empty((flat.size, self.dim), np.float32)
        if self._pool is None or flat.size < 4096:
            self._read_into(out, flat)
        else:
            cut = np.linspace(0, flat.size, self.threads + 1).astype(int)
            for job in [
                self._pool.submit(self._read_into, out[a:b], flat[a:b])
                for a, b in zip(cut[:-1], cut[1:], strict=True)
            ]:
                job.result()
        return out.reshape(*ids.shape, self.dim)

    def update_rows(self, ids_unique, new_rows) -> None:
        """Write rows in place: ids int [n] distinct, new_rows float [n, E] (cast to the
        table dtype; fp8 rows are re-quantised with a fresh row scale)."""
        if self.mode != "r+":
            raise PermissionError(f"TableFile.update_rows: {self.path} opened read-only")
        ids = self._check_ids(ids_unique, "update_rows")
        rows = np.asarray(new_rows)
        if ids.ndim != 1 or rows.shape != (ids.size, self.dim):
            raise ValueError(
                f"TableFile.update_rows: ids must be [n] and rows [n, {self.dim}], got "
                f"ids {ids.shape}, rows {rows.shape}"
            )
        if not np.issubdtype(rows.dtype, np.floating) and rows.dtype not in DTYPES.values():
            raise TypeError(f"TableFile.update_rows: rows must be floating, got {rows.dtype}")
        run = bool(ids.size) and ids[-1] - ids[0] + 1 == ids.size and np.all(np.diff(ids) == 1)
        if not run and np.unique(ids).size != ids.size:
            raise ValueError("TableFile.update_rows: ids must be distinct")
        data, scale = _encode(rows, self.dtype)
        self._write(ids, data, scale, run)
        _set_bits(self.dirty, ids)

    def _write(self, ids, data: np.ndarray, scale: np.ndarray | None, run: bool) -> None:
        if run:
            sl = slice(int(ids[0]), int(ids[-1]) + 1)  # a contiguous run: one slice copy
            self.data[sl] = data
            if scale is not None:
                self.scale[sl] = scale
        else:
            self.data[ids] = data
            if scale is not None:
                self.scale[ids] = scale
        if self.lazy:
            _set_bits(self.touched, ids)  # after the row: a set bit never precedes its value

    def flush(self) -> None:
        """msync every map (the live file; durability across crashes is the snapshot log)."""
        for m in (self.data, self.scale, self.touched, self.dirty):
            if m is not None and self.mode == "r+":
                m.flush()

    def snapshots(self) -> list[int]:
        """Steps of the committed snapshot segments, ascending (temp files ignored)."""
        names = os.listdir(os.path.join(self.path, "log"))
        return sorted(int(n[5:-4]) for n in names if n.startswith("step_") and n.endswith(".seg"))

    def snapshot(self, step: int, chunk_rows: int = 1 << 16) -> str:
        """Append the rows written since the last snapshot as segment `step` (> every earlier
        one); returns its path. Memory: one chunk of rows, plus the dirty ids."""
        done = self.snapshots()
        if done and step <= done[-1]:
            raise ValueError(f"TableFile.snapshot: step {step} <= last snapshot {done[-1]}")
        ids = np.flatnonzero(np.unpackbits(self.dirty, bitorder="little")[: self.num_rows])
        log = os.path.join(self.path, "log")
        tmp, final = os.path.join(log, ".tmp"), os.path.join(log, f"step_{step:012d}.seg")
        with open(tmp, "wb") as f:
            f.write(b"\0" * _SEG.size)
            crc = _stream(f, ids, 0)
            for a in range(0, ids.size, chunk_rows):
                crc = _stream(f, np.take(self.data, ids[a : a + chunk_rows], axis=0), crc)
            if self.fp8:
                crc = _stream(f, np.take(self.scale, ids), crc)
            f.seek(0)
            isz = self.dtype.itemsize
            f.write(_SEG.pack(_MAGIC, VERSION, self.fp8, step, ids.size, self.dim, isz, crc))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync_dir(log)
        self.dirty[:] = 0
        return final

    def allocated_bytes(self) -> int:
        """Disk blocks the table directory really holds (sparse holes excluded)."""
        walk = os.walk(self.path)
        return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for d, _, ns in walk for n in ns)

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown()
        self.data = self.scale = self.touched = self.dirty = None

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stream(f, arr, crc: int) -> int:
    buf = memoryview(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
    f.write(buf)
    return zlib.crc32(buf, crc)


def read_segment(path: str, dim: int, itemsize: int) -> tuple[int, np.ndarray, np.memmap, object]:
    """Validate a segment (size, magic, CRC) -> (step, ids, rows memmap (raw bytes), scale)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_SEG.size).ljust(_SEG.size, b"\0")  # a short one fails the checks below
        magic, ver, has_scale, step, n, d, isz, crc = _SEG.unpack(head)
        want = _SEG.size + n * (8 + d * isz + 4 * has_scale)
        if magic != _MAGIC or ver != VERSION or (d, isz) != (dim, itemsize) or size != want:
            raise ValueError(
                f"snapshot segment {path}: {size} bytes, expected {want} (magic {magic!r}, "
                f"version {ver}, dim {d}, itemsize {isz}): truncated or not this table's"
            )
        got = 0
        while chunk := f.read(1 << 24):
            got = zlib.crc32(chunk, got)
    if got != crc:
        raise ValueError(f"snapshot segment {path}: CRC mismatch (corrupt)")
    ids = np.fromfile(path, np.int64, n, offset=_SEG.size)
    off = _SEG.size + 8 * n
    rows = np.memmap(path, np.uint8, "r", off, (n, d * isz)) if n else np.zeros((0, d * isz))
    scale = np.fromfile(path, np.float32, n, offset=off + n * d * isz) if has_scale else None
    return step, ids, rows, scale


def restore_table_file(
    src: str, step: int, dest: str, chunk_rows: int = 1 << 16, threads: int | None = None
) -> TableFile:
    """The table `src` as it was at snapshot `step`, written to the new directory `dest`
    (a lazy table: init + segments <= step replayed, their files copied to `dest/log`)."""
    with open(os.path.join(src, "header.json")) as f:
        h = json.load(f)
    log = os.path.join(src, "log")
    names = sorted(n for n in os.listdir(log) if n.startswith("step_") and n.endswith(".seg"))
    use = [n for n in names if int(n[5:-4]) <= step]
    if not use or int(use[-1][5:-4]) != step:
        raise ValueError(f"restore_table_file: no snapshot {step} in {log} (have {names})")
    if os.path.exists(dest):
        raise FileExistsError(f"restore_table_file: {dest} already exists")
    isz = DTYPES[h["dtype"]].itemsize
    segments = [read_segment(os.path.join(log, n), h["dim"], isz) for n in use]  # all valid
    tmp = dest.rstrip("/") + ".restoring"
    shutil.rmtree(tmp, ignore_errors=True)
    i = h["init"]
    table = create_table_file(
        tmp,
        h["rows"],
        h["dim"],
        h["dtype"],
        seed=i["seed"],
        init_std=i["std"],
        lazy=True,
        progress=False,
    )
    for name, (_, ids, rows, scale) in zip(use, segments, strict=True):
        for a in range(0, ids.size, chunk_rows):
            b = a + chunk_rows
            data = np.asarray(rows[a:b]).view(table.dtype).reshape(-1, h["dim"])
            table._write(ids[a:b], data, None if scale is None else scale[a:b], False)
        shutil.copyfile(os.path.join(log, name), os.path.join(tmp, "log", name))
    table.close()
    os.rename(tmp, dest)
    return TableFile(dest, threads=threads)
