"""The workdir as an `etils.epath.Path`: a local directory or any URL epath supports.

Everything the training loop, `load_run` and the resume logic read or write in a workdir
goes through `epath.Path`, so `--workdir gs://bucket/run` (or s3://, az://) works as a local
directory does: orbax writes the checkpoints there itself (on GCS a step counts once its
commit marker is written, where a local step is renamed into place), and the run's small
files are written through epath. Local paths behave exactly as before: epath's local
backend is `os` and `open`, and local files are appended to and renamed as they were.

An object store differs from a filesystem in what this module hides:
- no append: a remote `config_changes.jsonl` is rewritten whole with its new line (each
  upload replaces the object at once, so a reader sees the old or the new file);
- the tokenizer and compression table are read and written by their libraries under a
  local name, so a remote copy is staged through a local temporary file.

What needs a local directory is refused before anything is written, naming the workdir
(`check_local_features`): memory-mapped Engram table files (`model.engram.table_path`),
the `jax.profiler` trace (`train.profile_steps`), and TensorBoard event files where
tensorboardX has no writer for the scheme (it writes gs:// with google-cloud-storage and
s3:// with boto3 itself).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from etils import epath

from v41jax import config as config_lib
from v41jax.config import Config

PathLike = str | os.PathLike


def as_path(workdir: PathLike) -> epath.Path:
    """`workdir` as an epath.Path; a URL scheme epath does not know is an error naming it
    (rather than a local directory named "memory:" made by accident)."""
    text = os.fspath(workdir)
    try:
        path = epath.Path(text)
    except KeyError:
        path = None
    scheme = text.split("://", 1)[0] if "://" in text else None
    if path is None or (scheme and not os.fspath(path).startswith(f"{scheme}://")):
        raise ValueError(
            f"workdir {text!r}: etils.epath does not support the {scheme}:// scheme here "
            "(use a local path or gs://, s3://, az://, hf://)"
        )
    return path


def is_local(path: PathLike) -> bool:
    """Whether `path` is on this machine's filesystem (no URL scheme)."""
    return "://" not in os.fspath(path)


def scheme_of(path: PathLike) -> str:
    return os.fspath(path).split("://", 1)[0] if not is_local(path) else ""


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Write `path` so that a kill mid-write keeps the old file: a temporary file renamed
    over it (local: os.replace; an object store replaces the object on upload)."""
    if not is_local(path):
        path.write_text(text)
        return
    tmp = path.parent / f"{path.name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)


def append_line(path: epath.Path, line: str) -> None:
    """Add one line to a text file: appended locally, rewritten whole on an object store."""
    if is_local(path):
        with path.open("a") as f:
            f.write(line + "\n")
        return
    old = path.read_text() if path.exists() else ""
    write_text_atomic(path, old + line + "\n")


def read_via_local(
    path: epath.Path, load: Callable[[str], Any], companions: tuple[str, ...] = ()
) -> Any:
    """`load(name)` of a file that `load` reads by local name; a remote file is copied to
    a local temporary directory first, with the `companions` beside it that exist (a
    tokenizer.json's tokenizer_config.json, which names its eos token)."""
    if is_local(path):
        return load(os.fspath(path))
    with tempfile.TemporaryDirectory(prefix="v41jax-stage-") as tmp:
        for name in (path.name, *companions):
            if name == path.name or (path.parent / name).exists():
                (epath.Path(tmp) / name).write_bytes((path.parent / name).read_bytes())
        return load(os.fspath(epath.Path(tmp) / path.name))


def write_via_local(path: epath.Path, save: Callable[[str], None]) -> None:
    """`save(name)` of a file that `save` writes by local name; a remote file is written
    into a local temporary directory first, and every file `save` wrote there (the file and
    any side file beside it, as `Tokenizer.save`'s tokenizer_config.json) is uploaded whole,
    the named file last."""
    if is_local(path):
        save(os.fspath(path))
        return
    with tempfile.TemporaryDirectory(prefix="v41jax-stage-") as tmp:
        local = epath.Path(tmp) / path.name
        save(os.fspath(local))
        for side in sorted(p for p in epath.Path(tmp).iterdir() if p.name != path.name):
            (path.parent / side.name).write_bytes(side.read_bytes())
        path.write_bytes(local.read_bytes())


def save_config(cfg: Config, path: epath.Path) -> None:
    """config.json, atomically (the text `config_lib.save_json` writes)."""
    write_text_atomic(path, json.dumps(config_lib.to_dict(cfg), indent=2, sort_keys=True))


def load_config(path: epath.Path) -> Config:
    """A run's config.json: a damaged (e.g. cut short) file or an unknown key is an error
    naming the file (`config_lib.load_json`)."""
    return config_lib.load_json(path)


def _tensorboard_writes(scheme: str) -> str | None:
    """None when tensorboardX can write event files under `scheme://`, else why not."""
    from tensorboardX import record_writer

    if scheme not in record_writer.REGISTERED_FACTORIES:
        return f"tensorboardX has no writer for {scheme}:// (it writes gs:// and s3://)"
    enabled = {"gs": "GCS_ENABLED", "s3": "S3_ENABLED"}.get(scheme)
    if enabled and not getattr(record_writer, enabled, False):
        package = {"gs": "google-cloud-storage", "s3": "boto3"}[scheme]
        return f"tensorboardX writes {scheme}:// only with {package} installed"
    return None


def check_local_features(cfg: Config, workdir: epath.Path) -> None:
    """Refuse, naming the workdir, what would need it to be a local directory."""
    if is_local(workdir):
        return
    engram = cfg.model.engram
    if engram.enabled and engram.table_path:
        raise ValueError(
            f"model.engram.table_path={engram.table_path!r} memory-maps the Engram tables in "
            f"local files, and workdir {os.fspath(workdir)} is not local (a resume on another "
            "machine would not find them): leave table_path empty (host tables are then kept "
            "in memory and saved in the checkpoints) or use a local workdir"
        )
    if cfg.train.profile_steps:
        raise ValueError(
            f"train.profile_steps={cfg.train.profile_steps!r} writes a jax.profiler trace to "
            f"a local directory, and workdir {os.fspath(workdir)} is not local: profile with a "
            "local workdir, or leave train.profile_steps empty"
        )
    if cfg.train.tensorboard and (why := _tensorboard_writes(scheme_of(workdir))):
        raise ValueError(
            f"train.tensorboard=true with workdir {os.fspath(workdir)}: {why}; set "
            "train.tensorboard=false (metrics.jsonl has the same numbers) or install it"
        )
