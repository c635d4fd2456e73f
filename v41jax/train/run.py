"""`Run`: one training run's workdir as both trainers write it (`train`, `train-drafter`).

    WORKDIR/<record>.json  the run's record (config.json: `run_files`; drafter.json)
    WORKDIR/checkpoints/   orbax checkpoints (`Checkpointer`)
    WORKDIR/metrics.jsonl  the log, with WORKDIR/tensorboard/ (`RunLog`)
    WORKDIR/eval.json      the final evaluation

The contract, the same for both trainers:
- paths are `etils.epath` paths, so the workdir may be gs://bucket/run as well as a local
  directory (`v41jax.train.workdir`);
- only process 0 writes the small files (record, log, eval.json); every process takes part
  in the checkpoints (orbax's collective save);
- a small file is written whole or not at all: a temporary file renamed over it locally, one
  object replaced on an object store, so a kill mid-write keeps the old file
  (`workdir.write_text_atomic`);
- the checkpointer is opened (and checkpoints/ created) only when asked for, so a command
  refused before its first write leaves the workdir as it was.

File names and JSON texts are the ones the trainers wrote before `Run` (existing runs resume).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from v41jax import config as config_lib
from v41jax.train import workdir as workdir_lib
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.steploop import Cadence, RunLog

EVAL_FILE = "eval.json"
CHECKPOINTS = "checkpoints"


class Run:
    """The workdir of one run: `path` (an epath.Path), its record, checkpoints, log and
    evaluation. `writes` is True on the process that writes the small files (process 0)."""

    def __init__(
        self, workdir: str | os.PathLike, keep_checkpoints: int, *, asynchronous: bool = False
    ):
        self.path: epath.Path = workdir_lib.as_path(workdir)
        self.keep_checkpoints = keep_checkpoints
        self.asynchronous = asynchronous
        self.writes = jax.process_index() == 0
        self._checkpointer: Checkpointer | None = None
        self._log: RunLog | None = None

    def __str__(self) -> str:
        return os.fspath(self.path)

    # small JSON files ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def read_json(self, name: str) -> Any:
        """The JSON in WORKDIR/name; damaged text is a ValueError naming the file."""
        return config_lib.read_json(self.path / name)

    def write_json(self, name: str, value: Any, *, sort_keys: bool = False) -> None:
        """WORKDIR/name = json.dumps(value, indent=2), atomically, by process 0 only (the
        workdir is made when missing)."""
        if not self.writes:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        text = json.dumps(value, indent=2, sort_keys=sort_keys)
        workdir_lib.write_text_atomic(self.path / name, text)

    def read_eval(self) -> dict:
        return self.read_json(EVAL_FILE)

    def write_eval(self, result: dict) -> None:
        """eval.json: the final evaluation (written once the run finished)."""
        self.write_json(EVAL_FILE, result)

    # checkpoints --------------------------------------------------------------------------

    def checkpointer(self) -> Checkpointer:
        """WORKDIR/checkpoints, opened (and created) on first use."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(
                self.path / CHECKPOINTS, self.keep_checkpoints, asynchronous=self.asynchronous
            )
        return self._checkpointer

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """The "params" subtree of checkpoint `step`'s state alone, in the shardings of
        `abstract_params` (ShapeDtypeStructs): an orbax partial restore, so nothing else
        of the state (the optimizer's moments) is read or needs a structure to read into."""
        directory = self.checkpointer().path / str(step) / "state"
        item = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(directory, args=args)["params"]

    # the log ----------------------------------------------------------------------------

    def open_log(
        self, start: int, *, tensorboard: bool = True, cadence: Cadence | None = None
    ) -> RunLog:
        """metrics.jsonl and tensorboard/, resumed at checkpoint `start` (`RunLog`);
        written by process 0 only."""
        self._log = RunLog(
            self.path, start, enabled=self.writes, tensorboard=tensorboard, cadence=cadence
        )
        return self._log

    def close(self) -> None:
        """Wait for the checkpoints in flight, then close the checkpointer and the log."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        if self._log is not None:
            self._log.close()
            self._log = None
