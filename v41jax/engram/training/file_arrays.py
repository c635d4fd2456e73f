"""Engram tables in memory-mapped files during training (`model.engram.table_path`).

The host-table run of `v41jax.engram.training.host` with every table and optimizer-state array
in a `TableFile` instead of RAM, so a table may be larger than this machine's memory: a
step reads and writes only the rows its batch touches, and the OS page cache keeps the hot
(Zipf-frequent) rows resident. Layout, per Engram layer l, under the table directory:

    layer_<l>/            the table [R, C] float32 (lazy: a row is its init until written)
    layer_<l>.<name>/     each row-sparse state array (sparse_adam: m, v [R, C], k [R, 1];
                          rowwise_adagrad: acc [R, 1]), zero-initialised, also lazy
    owner.json            the workdir that owns these files

Checkpoints never copy a table: at step s every file appends the rows written since the
previous checkpoint to its snapshot log (`TableFile.snapshot`), before the orbax checkpoint
of step s is written, so every complete checkpoint has its snapshots. Resuming at step s
rebuilds each file as of snapshot s (`restore_table_file`: the init plus the segments up to
s) unless the file is already exactly that (no row written since snapshot s, the last one).
The step counts `k` are stored as float32, exact below 2^24 updates of a row.

The table directory is `table_path`, or `<workdir>/<table_path>` when it is relative.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from v41jax.config import Config
from v41jax.engram import table_optim
from v41jax.engram.layer import Engram
from v41jax.engram.primes import stored_table_rows
from v41jax.engram.table_file import TableFile, create_table_file, restore_table_file

_EXACT_COUNT = 2**24  # float32 holds every integer below this


def table_dir(cfg: Config, workdir: str) -> str:
    path = os.path.expanduser(cfg.model.engram.table_path)
    return path if os.path.isabs(path) else os.path.join(workdir, path)


class FileArray:
    """A `TableFile` seen as the numpy array HostTables indexes: a[ids] gathers rows,
    a[ids] = rows writes distinct rows in place. `dtype` int32 stores counts as float32."""

    def __init__(self, table: TableFile, dtype=np.float32):
        self.file, self.dtype = table, np.dtype(dtype)
        self.shape = (table.num_rows, table.dim)

    def __getitem__(self, ids) -> np.ndarray:
        rows = self.file.gather(np.asarray(ids))
        return rows.astype(self.dtype) if self.dtype != np.float32 else rows

    def __setitem__(self, ids, rows) -> None:
        rows = np.asarray(rows)
        if self.dtype == np.int32 and rows.size and rows.max() >= _EXACT_COUNT:
            raise OverflowError(f"{self.file.path}: a row count reached {int(rows.max())}")
        self.file.update_rows(np.asarray(ids), rows.astype(np.float32))


def _state_shapes(kind: str, dim: int) -> dict[str, tuple[int, np.dtype]]:
    zero = table_optim.init_state(kind, 1, dim, xp=np)
    return {name: (a.shape[1], a.dtype) for name, a in zero.items()}


def _paths(root: str, layer: int, kind: str, dim: int) -> dict[str, tuple[str, int, np.dtype]]:
    """{"table" | state name: (directory, row width, dtype)} of one layer."""
    out = {"table": (os.path.join(root, f"layer_{layer}"), dim, np.dtype(np.float32))}
    for name, (width, dtype) in _state_shapes(kind, dim).items():
        out[name] = (os.path.join(root, f"layer_{layer}.{name}"), width, dtype)
    return out


def _claim(root: str, workdir: str) -> None:
    """Make `root` this workdir's table directory, refusing one that belongs elsewhere."""
    owner_path, me = os.path.join(root, "owner.json"), os.path.abspath(workdir)
    if os.path.exists(root) and os.listdir(root):
        owner = json.load(open(owner_path)) if os.path.exists(owner_path) else None
        if owner is None or owner.get("workdir") != me:
            raise FileExistsError(
                f"model.engram.table_path: {root} exists and does not belong to {me} "
                f"(owner: {owner}); pick another path or remove it"
            )
        return
    os.makedirs(root, exist_ok=True)
    with open(owner_path, "w") as f:
        json.dump({"workdir": me}, f)


def open_table_files(cfg: Config, workdir: str, start: int, tables: dict | None = None):
    """(tables {layer: FileArray}, states {layer: {name: FileArray}}) at step `start`.

    start 0: fresh lazy files (a leftover of this workdir's run killed before its first
    checkpoint is replaced), each table filled from `tables` ({layer: [R, C]}, a fine-tuning
    source) if given. start > 0: the files as of snapshot `start`."""
    engram, kind, root = cfg.model.engram, cfg.optim.table_optimizer, table_dir(cfg, workdir)
    _claim(root, workdir)
    out_tables, out_states = {}, {}
    for layer in engram.layer_ids:
        rows = stored_table_rows(engram, layer)
        arrays = {}
        for name, (path, width, dtype) in _paths(root, layer, kind, engram.head_dim).items():
            if start == 0:
                shutil.rmtree(path, ignore_errors=True)
                std = Engram.init_std if name == "table" else 0.0
                seed = cfg.train.seed * 1009 + layer  # a table's init: f(seed, layer, row)
                f = create_table_file(path, rows, width, seed=seed, init_std=std, progress=False)
            else:
                f = _at_snapshot(path, start)
            arrays[name] = FileArray(f, dtype)
        if start == 0 and tables is not None:
            src = np.asarray(tables[layer], np.float32)
            for a in range(0, rows, 1 << 16):
                ids = np.arange(a, min(a + (1 << 16), rows))
                arrays["table"][ids] = src[ids]
        out_tables[layer] = arrays.pop("table")
        out_states[layer] = arrays
    return out_tables, out_states


def _at_snapshot(path: str, step: int) -> TableFile:
    """The TableFile at `path` as of snapshot `step` (rebuilt from its log unless it is)."""
    f = TableFile(path)
    if _is_at_snapshot(f, step):
        return f
    f.close()
    fresh = path.rstrip("/") + ".restored"
    shutil.rmtree(fresh, ignore_errors=True)
    restore_table_file(path, step, fresh).close()
    old = path.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(path, old)
    os.rename(fresh, path)
    shutil.rmtree(old)
    return TableFile(path)


def _is_at_snapshot(f: TableFile, step: int) -> bool:
    """Whether `f` holds exactly its snapshot `step` (its last, nothing written since);
    raises when the log has no snapshot `step`."""
    done = f.snapshots()
    if step not in done:
        raise FileNotFoundError(f"{f.path}: no snapshot of step {step} (have {done})")
    return done[-1] == step and not f.dirty.any()


def snapshot_all(tables: dict, states: dict, step: int) -> None:
    """Append every file's rows written since the last checkpoint to its log as `step`."""
    for layer, table in tables.items():
        for a in (table, *states[layer].values()):
            a.file.flush()
            a.file.snapshot(step)


def read_only_tables(cfg: Config, workdir: str, step: int) -> dict[int, TableFile]:
    """{layer: TableFile} of the run's tables as of checkpoint `step`, for decoding: the live
    files when they are that state, else a copy rebuilt from the logs (`.step_<s>` dirs)."""
    root, out = table_dir(cfg, workdir), {}
    for layer in cfg.model.engram.layer_ids:
        path = os.path.join(root, f"layer_{layer}")
        f = TableFile(path, mode="r")
        if not _is_at_snapshot(f, step):
            f.close()
            copy = f"{path}.step_{step}"
            if not os.path.exists(copy):
                restore_table_file(path, step, copy).close()
            f = TableFile(copy, mode="r")
        out[layer] = f
    return out
