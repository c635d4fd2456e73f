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
`model.engram.table_path` the arrays are memory-mapped files (`file_arrays`, `files`).

`HostTableStrategy` is the run's `TableStrategy`: the TrainState holds the params without
the tables and opt_state {"dense": optax state, "tables": {}}; host RAM holds every table
[R, C] float32 and its row-sparse state (sparse_adam: m, v [R, C], k [R, 1]; rowwise_adagrad:
acc [R, 1]). Step cost: the host gathers U <= B T H rows per layer (prefetch thread), sends
[U, C] to the device and receives their gradients [U, C], and updates those rows in place;
the device never holds a table. Checkpoint: every table and state array (item "host_tables").
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np

from v41jax.config import Config
from v41jax.engram import table_optim
from v41jax.engram.host_table import HostTable
from v41jax.engram.primes import head_offsets, stored_table_rows
from v41jax.engram.training.file_arrays import FileArray, snapshot_all
from v41jax.engram.training.sparse import (
    SparseTableStrategy,
    host_train_step,
    split_tables,
    table_update_hyper,
)
from v41jax.engram.tree_keys import engram_ids_key, engram_rows_key

HOST_KEY = "_host_rows"  # batch entry that never goes to the device: {layer: u [N]}
VERSION_KEY = "_host_version"


class HostTables:
    """{layer: table [R, C] float32} and their row-sparse states, with the update log."""

    def __init__(self, cfg: Config, tables: dict[int, np.ndarray], states: dict | None = None):
        self.cfg, self.kind = cfg, cfg.optim.table_optimizer
        table_optim.check_kind(self.kind)
        keep = lambda a, dtype=None: a if isinstance(a, FileArray) else np.array(a, dtype)  # noqa: E731
        self.files = all(isinstance(t, FileArray) for t in tables.values())
        self.tables = {int(k): keep(v, np.float32) for k, v in tables.items()}
        self.states = (
            {
                layer: table_optim.init_state(self.kind, *t.shape, xp=np)
                for layer, t in self.tables.items()
            }
            if states is None
            else {int(k): {n: keep(a) for n, a in st.items()} for k, st in states.items()}
        )
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

    def apply(self, rows_by_layer: dict, grads_by_layer: dict, lr: float, step: int = 0) -> None:
        """One sparse optimizer step per table at its rows u (fill entries dropped); `step`:
        the step being taken (1-based; what sinkhorn_sparse's momentum decay counts)."""
        if self.kind == "sinkhorn_sparse" and step < 1:
            raise ValueError(f"HostTables.apply: sinkhorn_sparse needs the step (>= 1), got {step}")
        touched = {}
        for layer, rows_u in rows_by_layer.items():
            table, state = self.tables[layer], self.states[layer]
            keep = rows_u < table.shape[0]
            at = np.minimum(rows_u, table.shape[0] - 1)  # fill entries: computed, discarded
            # the update of the touched rows runs the same XLA arithmetic as a device-table
            # step (numpy's pow/sqrt round differently, and training amplifies 1-ulp gaps);
            # all N entries, so one compiled shape serves every step
            new_rows, new_state = self._update(
                table[at],
                {k: v[at] for k, v in state.items()},
                np.asarray(grads_by_layer[layer]),
                lr,
                keep,
                np.int32(step),
            )
            table[rows_u[keep]] = np.asarray(new_rows)[keep]
            for k, v in new_state.items():
                state[k][rows_u[keep]] = np.asarray(v)[keep]
            touched[layer] = rows_u[keep]
        with self._lock:
            self.version += 1
            self._log.append((self.version, touched))
            del self._log[:-8]  # batches are prefetched a few steps ahead at most

    def _update(self, rows_UxC, state_rows, grads_UxC, lr, keep_U, step):
        """sparse_update on the gathered rows alone (`table_optim.gathered_update_program`,
        the program device sinkhorn_sparse tables run too); fill entries (keep False) take
        no part."""
        program = table_optim.gathered_update_program(self.kind, **table_update_hyper(self.cfg))
        return program(rows_UxC, state_rows, grads_UxC, lr, keep_U, step)

    def checkpoint(self, step: int) -> dict | None:
        """What `Checkpointer.save` stores for step `step`: the arrays (`state_dict`), or for
        file tables None, after every file has appended its rows written since the last
        checkpoint to its snapshot log (`v41jax.engram.training.file_arrays`)."""
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


class HostTableStrategy(SparseTableStrategy):
    """Tables in host memory, updated on the host (`table_placement` "host"; module doc).
    After `open`, `tables` is the run's `HostTables`."""

    name = "host"
    outside_params = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.tables: HostTables | None = None

    def state_params(self, params):
        return split_tables(params)[0]  # the compiled init never builds the tables

    def train_step(self, dense_step, forward_loss, optimizer, schedule, module_norms):
        return host_train_step(self.cfg, forward_loss, optimizer, schedule, module_norms)

    def step_out_shardings(self, out_shardings: tuple, replicated) -> tuple:
        return (*out_shardings, replicated)  # the row gradients, read back by the host

    def finish_step(self, outputs: tuple) -> tuple:
        return outputs  # the host applies the row gradients in `step`

    def batch_shardings(self, shardings: dict, replicated) -> dict:
        layers = self.cfg.model.engram.layer_ids  # every device reads all gathered rows
        return shardings | {engram_rows_key(layer): replicated for layer in layers}

    def open(self, checkpointer, step: int, workdir: str, init_tables, source_tables=None):
        if step:
            like = shaped_like(self.cfg).state_dict()
            restored = checkpointer.restore_tables(step, like)
            self.tables = HostTables.from_state_dict(self.cfg, restored)
            return
        if source_tables is None:
            source_tables = init_tables(self.cfg.train.seed)
        self.tables = HostTables(self.cfg, source_tables)

    def prepare_batch(self, batch: dict) -> dict:
        return self.tables.gather(batch)  # rows gathered in the prefetch thread

    def step(self, train_step, to_device, state, batch: dict):
        """Patch the batch's stale rows, run the device step, apply the returned row
        gradients on the host (lr = the step's lr x table_lr_scale)."""
        batch, rows = self.tables.patch(batch)
        state, metrics, grads = train_step(state, to_device(batch))
        grads, lr = jax.device_get((grads, metrics["lr"]))
        lr = np.float32(lr) * np.float32(self.cfg.model.engram.table_lr_scale)
        self.tables.apply(rows, grads, lr, step=int(jax.device_get(state.step)))
        return state, metrics

    def eval_batch(self, batch: dict) -> dict:
        return self.tables.patch(self.tables.gather(batch))[0]  # the rows as they are now

    def checkpoint(self, step: int):
        return self.tables.checkpoint(step)

    def decoding_config(self, cfg: Config) -> Config:
        engram = dataclasses.replace(cfg.model.engram, table_placement="device", table_path="")
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engram=engram))

    def decoding_tables(self, checkpointer, step: int, workdir: str):
        restored = checkpointer.restore_tables(step, shaped_like(self.cfg).state_dict())
        tables = HostTables.from_state_dict(self.cfg, restored).tables
        return {layer: HostTable(t) for layer, t in tables.items()}
