"""`drafter.json`: a drafter run's record, and the checks every later use makes against it.

    {"config": DrafterRunConfig as a dict,
     "target_workdir": the target's path relative to the drafter's workdir (older runs: an
                       absolute path; a URL when the two are on different filesystems),
     "target_step", "target_identity": the target's step and `run_identity` hash,
     "init_from": the drafter workdir step 0 started from (relative), or null}

Read and written through `v41jax.train.run.Run` (epath paths, process 0, atomic), so a
gs:// workdir is read and written as a local one.
"""

from __future__ import annotations

import os
import posixpath
import sys

from v41jax import config as config_lib
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.train import run_identity
from v41jax.train.run import Run

CONFIG_FILE = "drafter.json"


def _split(path: str | os.PathLike) -> tuple[str, str]:
    """("gs", "bucket/dir") for a URL, ("", absolute local path) for a local path."""
    text = os.fspath(path)
    if "://" not in text:
        return "", os.path.abspath(text)
    scheme, rest = text.split("://", 1)
    return scheme, rest


def relative_to_workdir(path: str | os.PathLike, workdir: str | os.PathLike) -> str:
    """`path` as the record keeps it: relative to `workdir` when both are on one filesystem
    (a moved pair still finds each other), else `path` itself."""
    (scheme, a), (other, b) = _split(path), _split(workdir)
    if scheme != other:
        return os.fspath(path)
    return os.path.relpath(a, b) if not scheme else posixpath.relpath(a, b)


def recorded_target(workdir: str | os.PathLike, record: dict) -> str:
    """The target workdir a drafter run records (relative to the drafter's workdir; older
    runs recorded an absolute path)."""
    target = record["target_workdir"]
    if "://" in target:
        return target
    scheme, base = _split(workdir)
    if not scheme:
        return os.path.normpath(os.path.join(os.fspath(workdir), target))
    return f"{scheme}://{posixpath.normpath(posixpath.join(base, target))}"


def make_record(cfg: DrafterRunConfig, workdir, target, target_workdir, init_from) -> dict:
    """The record of a drafter run of `cfg` in `workdir` against `target` (a LoadedRun read
    from `target_workdir`), started from the drafter in `init_from` (or None)."""
    return {
        "config": config_lib.to_dict(cfg),
        "target_workdir": relative_to_workdir(target_workdir, workdir),
        "target_step": int(target.step),
        "target_identity": run_identity(target.cfg),
        "init_from": relative_to_workdir(init_from, workdir) if init_from else None,
    }


def check_record(run: Run, record: dict) -> bool:
    """False for a new run; True for a resumable one; ValueError for a different one. The
    target's path may differ (a moved target) when its identity and step agree."""
    if not run.has(CONFIG_FILE):
        return False
    old = run.read_json(CONFIG_FILE)
    # settings added since the run was made read as their defaults
    old["config"] = config_lib.to_dict(config_lib.from_dict(DrafterRunConfig, old["config"]))
    ignored = ["target_workdir", "init_from"]  # init_from only seeds step 0
    if "target_identity" not in old:  # recorded before identities: the path must agree
        ignored.append("target_identity")
        if _split(recorded_target(run.path, old)) != _split(recorded_target(run.path, record)):
            raise ValueError(
                f"workdir {run} holds a drafter run of the target "
                f"{recorded_target(run.path, old)}, not {record['target_workdir']}"
            )
    diffs = config_lib.diff(
        {k: v for k, v in old.items() if k not in ignored},
        {k: v for k, v in record.items() if k not in ignored},
    )
    if diffs:
        raise ValueError(
            f"workdir {run} holds a drafter run with different settings "
            f"({'; '.join(diffs)}); use a new --workdir, or the original settings to resume"
        )
    return True


def write_record(run: Run, record: dict) -> None:
    """drafter.json (process 0, atomically; the text written before `Run`: sorted keys)."""
    run.write_json(CONFIG_FILE, record, sort_keys=True)


def load_record(run: Run) -> dict:
    if not run.has(CONFIG_FILE):
        raise FileNotFoundError(f"{run} holds no drafter run (no {CONFIG_FILE})")
    return run.read_json(CONFIG_FILE)


def load_drafter_config(workdir: str | os.PathLike) -> tuple[DrafterRunConfig, dict]:
    """(the run's config, its JSON record: target_workdir, target_step, ...)."""
    record = load_record(Run(workdir, keep_checkpoints=1))
    return config_lib.from_dict(DrafterRunConfig, record["config"]), record


def check_target(workdir: str | os.PathLike, record: dict, target) -> None:
    """ValueError unless `target` (a LoadedRun) is the model the drafter was trained for;
    a note on stderr when it has trained further since (realignment may help)."""
    workdir = os.fspath(workdir)
    want = record.get("target_identity")
    have = run_identity(target.cfg)
    if want is not None and want != have:
        raise ValueError(
            f"drafter {workdir} was trained for the target {recorded_target(workdir, record)} "
            f"(run identity {want}, step {record.get('target_step')}), but the target given "
            f"has identity {have}: a different model or data. Train a drafter for it: "
            "python -m v41jax train-drafter --target-workdir TARGET --workdir NEW"
        )
    if want is not None and int(target.step) != record.get("target_step"):
        print(
            f"note: drafter {workdir} was trained against step {record.get('target_step')} of "
            f"its target, which is now at step {target.step}; acceptance may be lower "
            "(realign: train-drafter --init-from this drafter, a new --workdir)",
            file=sys.stderr,
        )
