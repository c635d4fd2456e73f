"""One writer per workdir: a second train, train-drafter or sweep on a workdir another
process is writing is refused naming the holder; a stale lock (its pid gone, on this host) is
taken over with a note, another host's never; the lock is released after a run and on an
exception; on an object store it is written and read back."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.train import loop, train
from v41jax.train import workdir_lock as lock_lib
from v41jax.train.workdir_lock import WorkdirLocked, check_unlocked, workdir_lock

LOCK = ".v41jax.lock"
FAST = ["train.steps=2", "train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]


def tiny(*extra):
    return config_lib.override(config_lib.get_config("tiny"), FAST + list(extra))


def snapshot(path) -> dict | None:
    import hashlib

    if not os.path.exists(path):
        return None
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return out


@pytest.fixture
def live_pid():
    """A process of this host that runs for the test (a holder that is alive)."""
    child = subprocess.Popen(["sleep", "120"])
    yield child.pid
    child.kill()
    child.wait()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _hold(workdir, pid, host=None, pid_start="live"):
    """Write the lock a process `pid` of `host` would hold (pid_start "live": its own)."""
    os.makedirs(workdir, exist_ok=True)
    start = lock_lib._pid_start(pid) if pid_start == "live" else pid_start
    record = {"host": host or socket.gethostname(), "pid": pid, "pid_start": start,
              "since": "2024-01-01T00:00:00", "command": "train", "token": "theirs"}  # fmt: skip
    with open(os.path.join(workdir, LOCK), "w") as f:
        json.dump(record, f)
    return record


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("lock") / "run")
    train(tiny(), workdir, progress=False)
    return workdir


def test_a_normal_run_releases_its_lock(run2):
    assert os.path.exists(os.path.join(run2, "eval.json"))
    assert not os.path.exists(os.path.join(run2, LOCK))


@pytest.mark.e2e
def test_a_second_train_process_is_refused_naming_the_holder(run2, tmp_path):
    """This process holds the lock (as a running train would); `python -m v41jax train` on
    the same workdir, a new one and an existing run, exits 2 naming host, pid and since."""
    for workdir in (str(tmp_path / "new"), run2):
        before = snapshot(workdir)
        with workdir_lock(workdir, "train"):
            holder = json.load(open(os.path.join(workdir, LOCK)))
            assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
            out = subprocess.run(
                [sys.executable, "-m", "v41jax", "train", "--config", "tiny", "--workdir",
                 workdir, "--no-progress", "--set", "train.steps=2"],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert out.returncode == 2, out.stderr
            assert f"pid {os.getpid()} on host {socket.gethostname()}" in out.stderr
            assert f"since {holder['since']}" in out.stderr and workdir in out.stderr
        assert snapshot(workdir) == before  # the made folder is gone again, the run as it was


def test_train_drafter_and_a_sweep_cell_refuse_a_held_workdir(live_pid, tmp_path, capsys):
    target = tmp_path / "target"  # read only by its files before the lock is asked for
    target.mkdir()
    (target / "config.json").write_text("{}")
    drafter = str(tmp_path / "drafter")
    _hold(drafter, live_pid)
    argv = ["train-drafter", "--target-workdir", str(target), "--workdir", drafter]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{drafter} is being written by train (pid {live_pid} on host" in err
    assert os.listdir(drafter) == [LOCK]

    sweep_file = tmp_path / "sweep.py"
    sweep_file.write_text(textwrap.dedent(f"""
        from v41jax import config as config_lib
        from v41jax.sweep import RunSpec

        def get_sweep(setting="full"):
            return [RunSpec("s", "a", 0, config_lib.override(
                config_lib.get_config("tiny"), {FAST!r}))]
        """))  # fmt: skip
    runs = tmp_path / "runs"
    _hold(str(runs / "s" / "a_seed0"), live_pid)
    before = snapshot(runs)
    assert main(["sweep", str(sweep_file), "--runs-dir", str(runs), "--no-progress"]) == 2
    assert f"pid {live_pid}" in capsys.readouterr().err
    assert snapshot(runs) == before  # not even sweep.json
    # --list reads only: it still lists the held run
    assert main(["sweep", str(sweep_file), "--runs-dir", str(runs), "--list"]) == 0


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    """A lock left by a killed run on this host (dead pid, or a pid now running another
    process) is taken over, saying so; a live holder is not (negative control)."""
    workdir = str(tmp_path / "run")
    dead = _dead_pid()
    _hold(workdir, dead, pid_start=None)
    with workdir_lock(workdir, "train"):
        assert json.load(open(os.path.join(workdir, LOCK)))["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"taking over the stale lock of {workdir}" in err
    assert f"pid {dead} on host" in err and f"process {dead} is not running" in err
    assert not os.path.exists(os.path.join(workdir, LOCK))
    _hold(workdir, os.getppid(), pid_start=-1)  # a live pid whose start time differs: reused
    with workdir_lock(workdir, "train"):
        pass
    assert "is now another process" in capsys.readouterr().err


def test_a_sigkilled_holder_leaves_a_lock_the_next_run_takes_over(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    code = (
        "import os, signal, sys; from v41jax.train.workdir_lock import workdir_lock; "
        "held = workdir_lock(sys.argv[1], 'train'); held.__enter__(); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code, workdir], timeout=300)  # fmt: skip
    assert out.returncode == -signal.SIGKILL
    killed = json.load(open(os.path.join(workdir, LOCK)))
    assert lock_lib._stale(killed) == f"process {killed['pid']} is not running"
    check_unlocked(workdir)  # its pid is gone: not a live holder
    with workdir_lock(workdir, "train"):
        pass
    assert f"pid {killed['pid']} on host" in capsys.readouterr().err
    assert os.listdir(workdir) == []


def test_another_hosts_lock_is_refused_not_taken_over(tmp_path, live_pid):
    workdir = str(tmp_path / "run")
    record = _hold(workdir, _dead_pid(), host="elsewhere")
    with pytest.raises(WorkdirLocked, match=r"pid \d+ on host elsewhere.*if that run is gone"):
        with workdir_lock(workdir, "train"):
            pass
    assert json.load(open(os.path.join(workdir, LOCK))) == record
    _hold(workdir, live_pid)  # this host, alive: refused too
    with pytest.raises(WorkdirLocked, match=f"pid {live_pid} on host"):
        check_unlocked(workdir)
    open(os.path.join(workdir, LOCK), "w").close()  # a lock with no content: named
    with pytest.raises(WorkdirLocked, match="unreadable lock file"):
        with workdir_lock(workdir, "train"):
            pass


def test_released_on_an_exception_and_after_a_refusal(run2, tmp_path, monkeypatch):
    """A refusal found while holding the lock leaves the folder as it was (a new one is not
    left behind); an exception mid-run releases the lock and keeps what was written."""
    new = str(tmp_path / "new")
    with pytest.raises(ValueError, match="train.eval_batches=500"):
        train(tiny("train.eval_batches=500"), new, progress=False)
    assert not os.path.exists(new)
    before = snapshot(run2)
    with pytest.raises(ValueError, match="different config"):
        train(tiny("optim.lr=0.1"), run2, progress=False)
    assert snapshot(run2) == before

    def boom(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(loop, "evaluate", boom)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(tiny("train.async_checkpoints=false"), str(tmp_path / "crash"), progress=False)
    assert {"config.json", "metrics.jsonl", "checkpoints"} <= set(os.listdir(tmp_path / "crash"))
    assert not os.path.exists(tmp_path / "crash" / LOCK)


def test_re_entrant_and_held_by_process_0_only(tmp_path, monkeypatch):
    workdir = str(tmp_path / "run")
    with workdir_lock(workdir, "sweep"):
        with workdir_lock(workdir, "train"):  # the sweep's cell calls train inside
            pass
        assert json.load(open(os.path.join(workdir, LOCK)))["command"] == "sweep"
    assert not os.path.exists(workdir)
    monkeypatch.setattr(lock_lib, "_primary", lambda: False)  # process 1 of a job
    with workdir_lock(workdir, "train"):
        assert not os.path.exists(os.path.join(workdir, LOCK))


class FakeGCS(MemoryFileSystem):
    """gs://bucket/... in memory: no exclusive create, as on GCS."""

    protocol = ("gs", "gcs")
    store, pseudo_dirs = {}, [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        path = path[len("gs://") :] if path.startswith("gs://") else path.lstrip("/")
        return "/" + path.rstrip("/")


@pytest.fixture
def gcs(monkeypatch):
    fs = FakeGCS()
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: fs)
    monkeypatch.setattr(lock_lib, "SETTLE_S", 0.01)
    return epath.Path("gs://bucket/run")


def test_on_an_object_store_the_lock_is_written_and_read_back(gcs, monkeypatch, live_pid):
    with workdir_lock("gs://bucket/run", "train"):
        assert json.loads((gcs / LOCK).read_text())["pid"] == os.getpid()
        (gcs / LOCK).write_text(json.dumps(_record_of(live_pid)))  # replaced meanwhile
    assert json.loads((gcs / LOCK).read_text())["pid"] == live_pid  # not ours: left
    with pytest.raises(WorkdirLocked, match=f"pid {live_pid} on host"):
        check_unlocked("gs://bucket/run")
    with pytest.raises(WorkdirLocked, match=f"pid {live_pid} on host"):
        with workdir_lock("gs://bucket/run", "train"):
            pass
    (gcs / LOCK).unlink()
    # two writers racing: the other's lock lands between our write and our read-back
    real_sleep = lock_lib.time.sleep

    def race(seconds):
        (gcs / LOCK).write_text(json.dumps(_record_of(live_pid)))
        real_sleep(seconds)

    monkeypatch.setattr(lock_lib.time, "sleep", race)
    with pytest.raises(WorkdirLocked, match=f"pid {live_pid}"):
        with workdir_lock("gs://bucket/run", "train"):
            pass
    assert json.loads((gcs / LOCK).read_text())["pid"] == live_pid  # theirs, kept


def _record_of(pid):
    return {"host": socket.gethostname(), "pid": pid, "pid_start": lock_lib._pid_start(pid),
            "since": "2024-01-01T00:00:00", "command": "train", "token": f"t{pid}"}  # fmt: skip
