"""Where Engram tables live while a run trains: one `TableStrategy` per run (`strategy`).

device   tables are params, trained by optax in the dense step        (`device`)
sparse   tables are params, row-sparse updates inside the step        (`sparse`)
host     numpy arrays in host RAM, row-sparse updates on the host     (`host`)
file     memory-mapped table files, updated like host tables          (`files`)
"""

from __future__ import annotations

from v41jax.config import DENSE_TABLE_OPTIMIZERS, Config
from v41jax.engram.training.device import DeviceTableStrategy
from v41jax.engram.training.files import FileTableStrategy
from v41jax.engram.training.host import HostTableStrategy
from v41jax.engram.training.sparse import SparseTableStrategy
from v41jax.engram.training.strategy import TableStrategy


def table_strategy(cfg: Config) -> TableStrategy:
    """The run's placement, from its config alone (so every caller chooses the same):
    host + table_path -> file; host -> host; a row-sparse table_optimizer -> sparse; else
    (or without Engram) device. The config guarantees host placements a sparse optimizer."""
    engram = cfg.model.engram
    if not engram.enabled:
        return DeviceTableStrategy(cfg)
    if engram.table_placement == "host":
        return (FileTableStrategy if engram.table_path else HostTableStrategy)(cfg)
    if cfg.optim.table_optimizer not in DENSE_TABLE_OPTIMIZERS:
        return SparseTableStrategy(cfg)
    return DeviceTableStrategy(cfg)
