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
carry a table item (numpy arrays the next steps update in place) are waited for.

A damaged step (a file cut short or lost after it was written) is found when its restore
raises and `damage` cannot read part of it back on its own terms: `restore_newest_intact`
names it and falls back to the newest step that restores, setting the damaged one aside
(`checkpoints/damaged/<step>-<time>`, never deleted) when the caller may write.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from v41jax.model.layout import convert_layout, layout_of, segments_of
from v41jax.train.workdir import as_path, is_local

ITEMS = ("state", "data")  # every step has these; TABLES_ITEM only some
# Arrays the run's Engram table strategy keeps outside the state (`TableStrategy.checkpoint`);
# the name is the saved layout (old checkpoints), not a statement about placement
TABLES_ITEM = "host_tables"
NAMED_ARRAYS = 3  # unreadable arrays named in a message; the rest are counted


class DamagedCheckpointError(ValueError):
    """No checkpoint to use is intact: every one (or the one asked for) is damaged."""


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _brief(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its text, without the
    tensorstore spec orbax appends (kilobytes of JSON)."""
    text = str(e).split(" [tensorstore_spec")[0].strip()
    line = text.splitlines()[0][:200] if text else ""
    files = re.findall(r'local file "([^"]*[^/"])"', text)  # the file itself, when it says
    if files and files[-1] not in line:
        line += f" ... {files[-1]}"
    return f"{type(e).__name__}: {line}"


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


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
                # numpy arrays of the table strategy (`v41jax.engram.training`)
                TABLES_ITEM: ocp.StandardCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, tables: Any = None) -> None:
        """tables: numpy tree (`TableStrategy.checkpoint`) saved in the same step."""
        if step in self.manager.all_steps():
            return
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state)}
        if tables is not None:
            items[TABLES_ITEM] = ocp.args.StandardSave(tables)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if tables is not None:  # numpy arrays the next steps update in place
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

    def restore_tables(self, step: int, like: Any) -> Any:
        """The numpy tree `save(..., tables=)` wrote at `step`, shaped like `like`."""
        restored = self.manager.restore(
            step, args=ocp.args.Composite(**{TABLES_ITEM: ocp.args.StandardRestore(like)})
        )
        return restored[TABLES_ITEM]

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["data"])

    def damage(self, step: int, error: BaseException | None = None) -> str | None:
        """What of checkpoint `step` cannot be read back as it was written (one line: the
        file or arrays, and the error), or None when all of it can. `error`: what the
        failed restore raised, quoted where the reader itself cannot say more.

        The step is read on its own terms: each JSON file orbax wrote must parse, and each
        array item must read from its saved metadata, one array at a time into host memory
        and into no model. A step that a restore refuses because the model or config differs
        from it reads fine here (a mismatch, not damage). Only called after a restore failed,
        so the good path never pays for this second read."""
        directory = self.path / str(step)
        present = {p.name for p in directory.iterdir()} if directory.exists() else set()
        if missing := [i for i in ITEMS if i not in present]:
            return f"{directory} lacks its {' and '.join(missing)} item"
        for item in ("data", "state", TABLES_ITEM):
            if item in present and (problem := self._item_damage(step, item, error)):
                return problem
        return None

    def _item_damage(self, step: int, item: str, error: BaseException | None) -> str | None:
        directory = self.path / str(step) / item
        files = [directory / "metadata", directory / "_METADATA", directory / "_sharding"]
        if (directory / "array_metadatas").exists():
            files += sorted((directory / "array_metadatas").iterdir())
        for path in files:  # orbax's JSON files: one cut short no longer parses
            if path.exists():
                try:
                    json.loads(path.read_text())
                except (ValueError, UnicodeDecodeError) as e:
                    return f"{os.fspath(path)} is not valid JSON ({_brief(e)})"
        if item == "data":
            return None
        try:
            tree = self.manager.item_metadata(step)[item]
            tree = getattr(tree, "tree", tree)
            names = [x.name for x in jax.tree.leaves(tree, is_leaf=_is_array)]
        except Exception as e:
            names, error = [], error or e
        if not names:
            why = f" ({_brief(error)})" if error is not None else ""
            return f"the metadata of {os.fspath(directory)} cannot be read{why}"
        as_numpy = ocp.RestoreArgs(restore_type=np.ndarray)
        bad, first = [], None
        for name in names:  # one array at a time: the damaged ones are named, memory bounded

            def pick(value, name=name):  # this array's `value`, a placeholder for the others
                return lambda m: value(m) if m.name == name else ocp.PLACEHOLDER

            only = ocp.args.PyTreeRestore(
                item=jax.tree.map(pick(lambda m: m), tree, is_leaf=_is_array),
                restore_args=jax.tree.map(pick(lambda m: as_numpy), tree, is_leaf=_is_array),
            )
            try:
                with ocp.PyTreeCheckpointer() as reader:
                    reader.restore(directory, args=only)
            except Exception as e:
                bad.append(name)
                first = first or _brief(e)
        if not bad:
            return None
        more = f" and {len(bad) - NAMED_ARRAYS} more" if len(bad) > NAMED_ARRAYS else ""
        return (
            f"{item} arrays {', '.join(bad[:NAMED_ARRAYS])}{more} in {os.fspath(directory)} "
            f"cannot be read ({first})"
        )

    def restore_newest_intact(
        self,
        restore: Callable[[int], Any],
        *,
        set_aside: bool,
        steps: list[int] | None = None,
        quiet: bool = False,
    ) -> tuple[int, Any] | None:
        """`(step, restore(step))` for the newest of `steps` (default: every checkpoint)
        whose restore succeeds; None when there are none.

        A step whose restore raises and that `damage` finds unreadable is damaged: a warning on
        stderr names it (not when `quiet`: processes other than 0), and the next older step
        is tried. `set_aside` (a command that may write the run: train) moves each damaged
        step to checkpoints/damaged/<step>-<time> (kept, never deleted; orbax no longer lists
        it, so the run saves that step anew); otherwise it stays where it is. A restore that
        fails on a readable step (the model or config does not match the checkpoint) raises
        as it is: older steps would fail alike. When every step tried is damaged:
        DamagedCheckpointError naming each, nothing moved.

        `restore` should read everything the caller takes from the step (the state and any table
        item), so that all of it comes from the one step that restored."""
        damaged: list[tuple[int, str]] = []
        for step in sorted(self.all_steps() if steps is None else steps, reverse=True):
            try:
                out = restore(step)
            except Exception as e:
                try:
                    what = self.damage(step, e)
                except Exception:  # the check itself failed: the restore's own error stands
                    what = None
                if what is None:
                    raise
                damaged.append((step, what))
                continue
            for bad, what in damaged:
                where = self._set_aside(bad, what) if set_aside else "left in place (read-only)"
                if not quiet:
                    _warn(
                        f"checkpoint {bad} in {self.directory} is damaged ({what}); {where}; "
                        f"using step {step}, the newest intact checkpoint"
                    )
            if damaged and set_aside:
                if jax.process_count() > 1:  # every process lists the same steps from here
                    ocp.multihost.sync_global_processes("v41jax_damaged_set_aside")
                self.manager.reload()
            return step, out
        if not damaged:
            return None
        listed = "; ".join(f"step {s}: {what}" for s, what in damaged)
        if steps is not None:
            raise DamagedCheckpointError(
                f"checkpoint {listed} in {self.directory} is damaged (the run has steps "
                f"{self.all_steps()}): ask for another step, or restore it from a copy"
            )
        raise DamagedCheckpointError(
            f"no intact checkpoint in {self.directory}: {listed}. Nothing was changed: restore "
            "these steps from a copy, or move the checkpoints directory away to start the run "
            "over from step 0"
        )

    def _set_aside(self, step: int, what: str) -> str:
        """Move damaged step `step` to checkpoints/damaged/<step>-<UTC time> (process 0);
        returns where, for the message."""
        target = self.path / "damaged" / f"{step}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        if jax.process_index() == 0:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                (self.path / str(step)).rename(target)
            except Exception as e:
                raise DamagedCheckpointError(
                    f"checkpoint {step} in {self.directory} is damaged ({what}) and could not "
                    f"be set aside as {os.fspath(target)} ({_brief(e)}): move it out of "
                    f"{self.directory} yourself and rerun"
                ) from e
        return f"set aside as {os.fspath(target)}"

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
