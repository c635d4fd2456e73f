"""Orbax checkpoints of (train state, data-iterator state) plus the stop-signal latch.

A checkpoint at step s holds everything needed to continue as if never stopped: params,
optimizer state, step, RNG (item "state") and the data iterator's position (item "data").
Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save (SIGKILL) leaves the previous checkpoint intact and the partial one is ignored.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
    """Keeps the last `keep` checkpoints of `directory` (absolute or relative path)."""

    def __init__(self, directory: str, keep: int):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                # Synchronous: a save has finished when save() returns, so the step we report
                # as saved is really on disk when a SIGKILL follows.
                enable_async_checkpointing=False,
            ),
            item_names=("state", "data"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into the shardings carried by `abstract_state` (ShapeDtypeStructs)."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["data"])

    def close(self) -> None:
        self.manager.close()


class StopSignal:
    """Latches SIGTERM/SIGINT so the loop can checkpoint and exit at a step boundary.

    A second Ctrl-C restores the default handler's behaviour (immediate KeyboardInterrupt).
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with the caller
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
