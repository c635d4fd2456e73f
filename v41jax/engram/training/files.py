"""The `TableStrategy` of Engram tables in memory-mapped files (`model.engram.table_path`).

Keeps: every table [R, C] and its row-sparse state arrays in `TableFile`s under the table
directory (layout: `file_arrays`), read and written through `FileArray`s by the same
`HostTables` as the host placement; RAM holds only the OS page cache of the hot rows. The
TrainState is the host placement's (params without the tables, opt_state "tables" {}).
Step cost: the host placement's, with each gathered / updated row a page-cache access (a
disk read on a miss). Checkpoint: no array goes to orbax; every file appends the rows
written since the previous checkpoint to its snapshot log, and `open` at step s rebuilds
the files as of snapshot s. The workdir must be local (the files are memory-mapped).
"""

from __future__ import annotations

from v41jax.engram.training.file_arrays import open_table_files, read_only_tables
from v41jax.engram.training.host import HostTables, HostTableStrategy


class FileTableStrategy(HostTableStrategy):
    """Host tables whose arrays are memory-mapped files (module doc)."""

    name = "file"

    def open(self, checkpointer, step: int, workdir: str, init_tables, source_tables=None):
        """The workdir's table files as of `step` (fresh lazy files at 0, each table filled
        from `source_tables` if given; the files carry their own init, so `init_tables` is
        not called)."""
        opened = open_table_files(self.cfg, workdir, step, source_tables)
        self.tables = HostTables(self.cfg, *opened)

    def check_workdir(self, workdir, local: bool) -> None:
        if not local:
            raise ValueError(
                f"{workdir}: model.engram.table_path={self.cfg.model.engram.table_path!r} "
                "tables are memory-mapped local files, and this workdir is not local"
            )

    def decoding_tables(self, checkpointer, step: int, workdir: str):
        return read_only_tables(self.cfg, workdir, step)  # memory-mapped, as of `step`
