"""One writer per workdir: a lock file held from before a command's first write to its end.

Two `train` processes started 2 s apart on one workdir both ran to the end, interleaving
metrics.jsonl and writing the same checkpoints. Now train, train-drafter (each drafter's
workdir) and the sweep (each cell, result.json and done.json included) hold
`<workdir>/.v41jax.lock` while they write. It is JSON: host, pid, pid_start (the process's
start time in clock ticks since boot, from /proc, where there is one), since (UTC), command
and a random token. A second writer is refused (`WorkdirLocked`, a FileExistsError: the CLI
prints one line and exits 2) naming the holder's command, pid, host and since when.

Stale locks: a lock whose host is this one and whose pid no longer runs (or runs another
process: its start time differs) was left by a run that could not release it (SIGKILL, a
lost machine); the next writer takes it over with a note on stderr. A lock from another host
is never taken over (its processes cannot be seen from here): the refusal names the file to
remove once that run is known to be gone.

Taking it. Local folders: os.open(O_CREAT | O_EXCL), an atomic exclusive create, so of two
writers exactly one gets it. Object stores (gs://, s3://, through `etils.epath`) have no
exclusive create: the lock is written, read back after `SETTLE_S` and kept only if it still
holds this writer's token (else the other writer's is named and left in place). That
guarantees one writer against any second writer that looks for a lock after the first's is
written (a rerun, a job started twice by mistake, a second run seconds later); of two writers
that both look before either writes, the later write wins unless the earlier writer's
read-back comes before it, i.e. both can proceed only if one takes longer than `SETTLE_S`
between looking and writing.

Releasing it: on the way out of `workdir_lock`, on success and on any exception (the file is
removed only while it still holds this writer's token). A refusal after the lock was taken
(a config that differs, found while holding it) therefore leaves the folder as it was: the
lock is removed, and so are the folders taking it created, when nothing else was written.

Re-entrant within a process (the sweep holds a cell's lock and calls train on it); in a
multi-host job process 0 holds it and every process agrees on whether it was taken, so they
all stop together when it was not.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
import uuid

from etils import epath

from v41jax.train import workdir as workdir_lib
from v41jax.train.workdir_kind import LOCK_FILE

SETTLE_S = 0.5  # object stores: wait before reading the written lock back
_HELD: dict[str, int] = {}  # lock path -> depth, the locks this process holds


class WorkdirLocked(FileExistsError):
    """Another writer holds the workdir's lock."""


def _primary() -> bool:
    import jax

    return jax.process_index() == 0


def _agree(ok: bool) -> bool:
    """Whether process 0 took the lock, agreed by every process of a multi-host job."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def _pid_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot; Linux), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _record(command: str) -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _pid_start(os.getpid()),
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "token": uuid.uuid4().hex,
    }


def _read(lock: epath.Path, wait_s: float = 1.0) -> dict | None:
    """The lock's JSON; None when there is no lock; {"unreadable": text} when it stays
    unparseable for `wait_s` (an exclusive create is visible before its content)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = lock.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        if time.monotonic() > deadline:
            return {"unreadable": text[:80]}
        time.sleep(0.05)


def _stale(holder: dict) -> str | None:
    """Why `holder`'s lock is stale (its process is gone), or None when it may be live."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    if pid == os.getpid():
        return "this process, which no longer holds it"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is not running"
    except PermissionError:
        pass  # it runs, as another user
    start, recorded = _pid_start(pid), holder.get("pid_start")
    if start is not None and recorded is not None and start != recorded:
        return f"pid {pid} is now another process"
    return None


def _who(holder: dict) -> str:
    return (
        f"{holder.get('command', '?')} (pid {holder.get('pid')} on host "
        f"{holder.get('host')}, since {holder.get('since')})"
    )


def _refusal(workdir: epath.Path, lock: epath.Path, holder: dict) -> WorkdirLocked:
    if "unreadable" in holder:
        return WorkdirLocked(
            f"{os.fspath(workdir)} has an unreadable lock file {os.fspath(lock)} "
            f"({holder['unreadable']!r}): if no command is writing there, remove it"
        )
    elsewhere = holder.get("host") != socket.gethostname()
    gone = "if that run is gone" if elsewhere else "if it is gone"
    return WorkdirLocked(
        f"{os.fspath(workdir)} is being written by {_who(holder)}: one writer per workdir; "
        f"wait for it to end or stop it ({gone}, remove {os.fspath(lock)})"
    )


def _take_over(workdir: epath.Path, lock: epath.Path, holder: dict, why: str) -> None:
    """Remove a stale lock (if it is still the one read), with a note on stderr."""
    print(
        f"note: taking over the stale lock of {os.fspath(workdir)}: held by {_who(holder)}, "
        f"but {why}",
        file=sys.stderr,
    )
    if _read(lock) == holder:
        lock.unlink(missing_ok=True)


def _make_dirs(workdir: epath.Path) -> list[epath.Path]:
    """Create `workdir` (and missing parents); the folders created, outermost first."""
    created, path = [], workdir
    while not path.exists() and path != path.parent:
        created.insert(0, path)
        path = path.parent
    workdir.mkdir(parents=True, exist_ok=True)
    return created


def _remove_empty(created: list[epath.Path]) -> None:
    for path in reversed(created):  # innermost first; a folder now holding files stays
        try:
            if path.exists() and not any(path.iterdir()):
                path.rmdir()
        except OSError:
            return


def _create(lock: epath.Path, record: dict) -> dict | None:
    """Write the lock unless there is one; None when taken, else the holder read back ({}
    when the lock vanished meanwhile: try again)."""
    text = json.dumps(record, indent=2)
    if workdir_lib.is_local(lock):
        try:
            fd = os.open(os.fspath(lock), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(lock)
            return {} if holder is None else holder
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return None
    if (holder := _read(lock)) is not None:
        return holder
    lock.write_text(text)
    time.sleep(SETTLE_S)
    back = _read(lock)
    return {} if back is None else None if back.get("token") == record["token"] else back


def _acquire(workdir: epath.Path, command: str) -> tuple[dict, list[epath.Path]]:
    lock, record = workdir / LOCK_FILE, _record(command)
    created = _make_dirs(workdir)
    try:
        for _ in range(5):  # a stale lock taken over, then created again
            holder = _create(lock, record)
            if holder is None:
                return record, created
            if not holder:  # released meanwhile
                continue
            why = _stale(holder)
            if why is None:
                raise _refusal(workdir, lock, holder)
            _take_over(workdir, lock, holder, why)
        raise _refusal(workdir, lock, _read(lock) or {"unreadable": ""})
    except BaseException:
        _remove_empty(created)
        raise


def _release(workdir: epath.Path, record: dict, created: list[epath.Path]) -> None:
    lock = workdir / LOCK_FILE
    holder = _read(lock)
    if holder is not None and holder.get("token") == record["token"]:
        lock.unlink(missing_ok=True)
    else:
        now = _who(holder) if holder and "unreadable" not in holder else "no lock"
        print(
            f"note: the lock of {os.fspath(workdir)} changed while this run held it "
            f"(now: {now}); left as it is",
            file=sys.stderr,
        )
    _remove_empty(created)


def _key(workdir: epath.Path) -> str:
    text = os.fspath(workdir)
    return os.path.abspath(text) if workdir_lib.is_local(workdir) else text.rstrip("/")


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike, command: str):
    """Hold `workdir`'s lock for the `with` block (module docstring); `command` names the
    writer in the lock, for the message a second writer gets."""
    path = workdir_lib.as_path(workdir)
    key = _key(path)
    if key in _HELD:  # re-entrant: the outer holder releases it
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    primary, taken, error = _primary(), None, None
    if primary:
        try:
            taken = _acquire(path, command)
        except Exception as e:  # every process must hear of it before any raises
            error = e
    if not _agree(error is None):
        raise error or WorkdirLocked(f"{os.fspath(path)}: process 0 could not take its lock")
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        if taken is not None:
            _release(path, *taken)


def check_unlocked(workdir: str | os.PathLike) -> None:
    """Raise `WorkdirLocked` when a live writer other than this process holds `workdir`'s
    lock; reads only (for commands that write elsewhere before taking it, as the sweep)."""
    path = workdir_lib.as_path(workdir)
    if _key(path) in _HELD or not (path / LOCK_FILE).exists():
        return
    holder = _read(path / LOCK_FILE)
    if holder is not None and _stale(holder) is None:
        raise _refusal(path, path / LOCK_FILE, holder)
