"""Orbax checkpoints of (train state, data-iterator state) plus the stop-signal latch.

A checkpoint at step s holds everything needed to continue as if never stopped: params,
optimizer state, step, RNG (item "state") and the data iterator's position (item "data").
A checkpoint of the other layer layout (scanned or not) is converted on restore.
Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save (SIGKILL) leaves the previous checkpoint intact and the partial one is ignored. On
GCS (a gs:// workdir), where nothing is renamed, a step counts once orbax has written its
commit marker, with the same effect.

`asynchronous=True` (the training loop's `train.async_checkpoints`): `save` returns once the
arrays are copied off the device, and orbax writes them in a background thread while
training continues; the next save, `wait` and `close` wait for it. A step is on disk only
when it is complete in that sense (what `latest_checkpoint_step` reads), so a
SIGKILL during a background write resumes from the previous checkpoint, exactly. Saves that
carry host tables (numpy arrays the next steps update in place) are waited for.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

from v41jax.model.layout import convert_layout, layout_of, segments_of
from v41jax.train.workdir import as_path, is_local


class Checkpointer:
    """Keeps the last `keep` checkpoints of `directory`: an absolute or relative local path,
    or any URL orbax and `etils.epath` write to (gs://bucket/run/checkpoints).
    `directory` is its text (local: made absolute), for messages."""

    def __init__(self, directory: str | os.PathLike, keep: int, asynchronous: bool = False):
        path = as_path(directory)
        self.path = path if not is_local(path) else as_path(os.path.abspath(path))
        self.directory = os.fspath(self.path)
        self.manager = ocp.CheckpointManager(
            self.path,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=asynchronous
            ),
            # handlers named up front (not just item names), so a fresh manager can read a
            # saved step's metadata before restoring it (the layer-layout check in restore)
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
                # Engram tables in host memory (numpy) and their optimizer states
                "host_tables": ocp.StandardCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, host_tables: Any = None) -> None:
        """host_tables: numpy tree (`HostTables.state_dict()`) saved in the same step."""
        if step in self.manager.all_steps():
            return
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state)}
        if host_tables is not None:
            items["host_tables"] = ocp.args.StandardSave(host_tables)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if host_tables is not None:  # numpy arrays the next steps update in place
            self.manager.wait_until_finished()

    def wait(self) -> None:
        """Block until every save issued so far is on disk."""
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into the shardings carried by `abstract_state` (ShapeDtypeStructs).

        A checkpoint written with the other layer layout (scanned runs "layers_a_b" vs one
        "block_i" per layer, e.g. a run saved before layers were scanned) is read in its own
        layout and converted (`v41jax.model.layout.convert_layout`: stacked or sliced along
        the leading axis, params and optimizer moments alike), then placed into the target
        shardings.
        """
        saved = layout_of(self._saved_params(step))
        target = layout_of(getattr(abstract_state, "params", abstract_state))
        if not saved or not target or saved == target:
            return self._restore(step, abstract_state)
        read_as = convert_layout(abstract_state, segments_of(saved))
        try:
            state, data = self._restore(step, read_as)
        except Exception as e:
            raise ValueError(
                f"checkpoint {step} in {self.directory} has layer layout {list(saved)}, the "
                f"model has {list(target)}, and converting it failed ({e}); restore it with "
                "the config it was written with (model.scan_layers) and convert the params "
                "with v41jax.model.convert_layout"
            ) from e
        converted = convert_layout(state, segments_of(target))
        shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
        return jax.device_put(converted, shardings), data

    def saved_tree(self, step: int) -> Any:
        """The saved state's metadata tree (nested dicts and lists of array metadata, the
        structure orbax wrote), or None when unreadable."""
        try:
            meta = self.manager.item_metadata(step)["state"]
        except Exception:  # no metadata: restore as usual, orbax reports any mismatch
            return None
        return getattr(meta, "tree", meta)

    def _saved_params(self, step: int) -> Any:
        """The saved state's metadata tree under "params" (None when unreadable)."""
        tree = self.saved_tree(step)
        return tree.get("params") if isinstance(tree, dict) else getattr(tree, "params", None)

    def restore_host_tables(self, step: int, like: Any) -> Any:
        """The numpy tree `save(..., host_tables=)` wrote at `step`, shaped like `like`."""
        restored = self.manager.restore(
            step, args=ocp.args.Composite(host_tables=ocp.args.StandardRestore(like))
        )
        return restored["host_tables"]

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["data"])

    def close(self) -> None:
        self.manager.wait_until_finished()
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
