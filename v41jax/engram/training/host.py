"""Engram tables in host memory during training (`model.engram.table_placement = "host"`).

The tables and their row-sparse optimizer states are numpy arrays; the device never holds
them. Per step s:

    input pipeline (background thread, ahead of need)   ids -> unique rows u, slots; e = T[u]
    device step                                          reads e[slots]; returns d loss / d e
    host (main thread, after the step)                   T, state <- sparse_update(u, grad)

A batch is gathered before the updates of the steps still running when it was prepared, so
its rows can be stale. Every update is logged with a version; a batch records the version it
was gathered at, and `patch` re-reads, just before the batch goes to the device, each of its
rows that an update since then touched. A host-table run therefore computes exactly what the
same run with device tables and the same sparse optimizer computes (tested step by step).
Single-process only: every process would need the same rows and updates. With
`model.engram.table_path` the arrays are memory-mapped files (`v41jax.train.file_tables`).
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np

from v41jax.config import Config
from v41jax.engram import table_optim
from v41jax.engram.primes import head_offsets, stored_table_rows
from v41jax.model import engram_ids_key, engram_rows_key
from v41jax.train.file_tables import FileArray, open_table_files, snapshot_all, uses_table_files

HOST_KEY = "_host_rows"  # batch entry that never goes to the device: {layer: u [N]}
VERSION_KEY = "_host_version"


def uses_host_tables(cfg: Config) -> bool:
    return cfg.model.engram.enabled and cfg.model.engram.table_placement == "host"


class HostTables:
    """{layer: table [R, C] float32} and their row-sparse states, with the update log."""

    def __init__(self, cfg: Config, tables: dict[int, np.ndarray], states: dict | None = None):
        self.cfg, self.kind = cfg, cfg.optim.table_optimizer
        table_optim.check_kind(self.kind)
        keep = lambda a, dtype=None: a if isinstance(a, FileArray) else np.array(a, dtype)  # noqa: E731
        self.files = all(isinstance(t, FileArray) for t in tables.values())
        self.tables = {int(k): keep(v, np.float32) for k, v in tables.items()}
        self.states = {
            layer: table_optim.init_state(self.kind, *t.shape, xp=np)
            for layer, t in self.tables.items()
        } if states is None else {
            int(k): {n: keep(a) for n, a in st.items()} for k, st in states.items()
        }  # fmt: skip
        self.version = 0
        self._log: list[tuple[int, dict[int, np.ndarray]]] = []
        self._lock = threading.Lock()

    def gather(self, batch: dict) -> dict:
        """The batch with each Engram layer's ids replaced by slots into its unique rows and
        those rows (zeros for the padding) added; host-only entries: the rows u, the version."""
        with self._lock:
            version = self.version
        out, host = dict(batch), {}
        for layer, table in self.tables.items():
            local = batch[engram_ids_key(layer)]
            flat = local.astype(np.int64) + head_offsets(self.cfg.model.engram, layer)
            uniq, inverse = np.unique(flat.ravel(), return_inverse=True)
            n, r = flat.size, table.shape[0]
            rows_u = np.full(n, r, np.int32)
            rows_u[: uniq.size] = uniq
            e = np.zeros((n, table.shape[1]), np.float32)
            e[: uniq.size] = table[uniq]
            out[engram_ids_key(layer)] = inverse.reshape(local.shape).astype(np.int32)
            out[engram_rows_key(layer)] = e
            host[layer] = rows_u
        out[HOST_KEY], out[VERSION_KEY] = host, version
        return out

    def patch(self, batch: dict) -> tuple[dict, dict]:
        """Re-read the batch's rows that updates since it was gathered touched (in place).
        Returns (the batch without its host-only entries, ready for the device, {layer: u})."""
        version = batch.pop(VERSION_KEY)
        host = batch.pop(HOST_KEY)
        if self._log and version < self._log[0][0] - 1:
            raise RuntimeError(f"batch gathered at version {version} is older than the log")
        for v, touched in self._log:
            if v <= version:
                continue
            for layer, rows_u in host.items():
                hit = np.isin(rows_u, touched[layer])
                if hit.any():
                    batch[engram_rows_key(layer)][hit] = self.tables[layer][rows_u[hit]]
        return batch, host

    def apply(self, rows_by_layer: dict, grads_by_layer: dict, lr: float) -> None:
        """One sparse optimizer step per table at its rows u (fill entries dropped)."""
        touched = {}
        for layer, rows_u in rows_by_layer.items():
            table, state = self.tables[layer], self.states[layer]
            keep = rows_u < table.shape[0]
            at = np.minimum(rows_u, table.shape[0] - 1)  # fill entries: computed, discarded
            # the update of the touched rows runs the same XLA arithmetic as a device-table
            # step (numpy's pow/sqrt round differently, and training amplifies 1-ulp gaps);
            # all N entries, so one compiled shape serves every step
            new_rows, new_state = self._update(
                table[at], {k: v[at] for k, v in state.items()},
                np.asarray(grads_by_layer[layer]), lr,
            )  # fmt: skip
            table[rows_u[keep]] = np.asarray(new_rows)[keep]
            for k, v in new_state.items():
                state[k][rows_u[keep]] = np.asarray(v)[keep]
            touched[layer] = rows_u[keep]
        with self._lock:
            self.version += 1
            self._log.append((self.version, touched))
            del self._log[:-8]  # batches are prefetched a few steps ahead at most

    def _update(self, rows_UxC, state_rows, grads_UxC, lr):
        """sparse_update on the gathered rows alone (rows 0..U-1 of a U-row table), jitted."""
        if not hasattr(self, "_jitted"):
            import jax

            o, engram = self.cfg.optim, self.cfg.model.engram

            def update(rows, state, grads, lr):
                ids = jnp.arange(rows.shape[0], dtype=jnp.int32)
                return table_optim.sparse_update(
                    self.kind, rows, state, ids, grads, lr, b1=o.b1, b2=o.b2, eps=o.eps,
                    weight_decay=engram.table_weight_decay,
                )  # fmt: skip

            self._jitted = jax.jit(update)
        return self._jitted(rows_UxC, state_rows, grads_UxC, lr)

    def checkpoint(self, step: int) -> dict | None:
        """What `Checkpointer.save` stores for step `step`: the arrays (`state_dict`), or for
        file tables None, after every file has appended its rows written since the last
        checkpoint to its snapshot log (`v41jax.train.file_tables`)."""
        if not self.files:
            return self.state_dict()
        snapshot_all(self.tables, self.states, step)
        return None

    def state_dict(self) -> dict:
        return {
            "tables": {str(k): v for k, v in self.tables.items()},
            "states": {str(k): v for k, v in self.states.items()},
        }

    @classmethod
    def from_state_dict(cls, cfg: Config, d: dict) -> HostTables:
        return cls(cfg, {int(k): v for k, v in d["tables"].items()}, d["states"])


def shaped_like(cfg: Config) -> HostTables:
    """Zero tables of the run's shapes (a restore target)."""
    engram = cfg.model.engram
    tables = {
        layer: np.zeros((stored_table_rows(engram, layer), engram.head_dim), np.float32)
        for layer in engram.layer_ids
    }
    return HostTables(cfg, tables)


def start_host_tables(
    cfg: Config, checkpointer, start: int, tables=None, workdir: str | None = None
) -> HostTables:
    """The run's host tables: restored from checkpoint `start` (if > 0), else `tables`
    ({layer: array}, e.g. a fine-tuning source's), else the init of `init_host_tables`.
    With `model.engram.table_path`: the workdir's table files at step `start`."""
    from v41jax.train.state import init_host_tables

    if uses_table_files(cfg):
        if workdir is None:
            raise ValueError("model.engram.table_path: start_host_tables needs the workdir")
        return HostTables(cfg, *open_table_files(cfg, workdir, start, tables))

    if start:
        like = shaped_like(cfg).state_dict()
        return HostTables.from_state_dict(cfg, checkpointer.restore_host_tables(start, like))
    if tables is None:
        tables = init_host_tables(cfg, cfg.train.seed)
    return HostTables(cfg, tables)


def host_step(train_step, host: HostTables, cfg: Config, mesh, state, batch):
    """One step of a host-table run: patch the batch's stale rows, run the device step, apply
    the returned row gradients on the host (lr = the step's lr x table_lr_scale)."""
    import jax

    from v41jax.train.step import device_batch

    batch, rows = host.patch(batch)
    state, metrics, grads = train_step(state, device_batch(mesh, batch))
    grads, lr = jax.device_get((grads, metrics["lr"]))
    host.apply(rows, grads, np.float32(lr) * np.float32(cfg.model.engram.table_lr_scale))
    return state, metrics
