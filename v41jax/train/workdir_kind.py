"""What a folder holds, read from its files alone, so that a command refuses a folder of
another kind before it writes anything.

Every command that writes into a folder (train, train-drafter, import-hf, export-hf, sweep,
report, prepare-data) calls `require_kind(folder, command)` first. Today's failure it
prevents: `train --workdir runs/tiny_drafter` wrote config.json, tokenizer.json and
compression.npz into a drafter's folder before orbax failed on its checkpoints. The kinds,
told apart by the files each writer leaves (first match wins; nothing is loaded but small
JSON files, and only through `etils.epath`, so gs:// folders are read the same way):

    drafter_run  drafter.json                          (`v41jax.dspark.train.record`)
    sweep_runs   sweep.json, or <study>/<run>/config.json or result.json below it
                                                       (`v41jax.sweep.driver`)
    token_dir    manifest.json                         (`v41jax.data.token_files`)
    hf_model     v41jax_export.json, or a Hugging Face config.json (model_type) with
                 safetensors                           (export-hf's output, an HF download)
    sweep_cell   config.json + result.json / done.json (a run a sweep finished)
    imported     config.json + checkpoint 0 whose "data" item records imported_from
                                                       (`v41jax.hf.workdir.import_hf`)
    train_run    config.json                           (`v41jax.train.loop.train`)
    report       summary.json / tables.md / study3.json (`v41jax.sweep.report`)
    empty, missing, file (not a folder), other (files of no kind above)

What each command writes into (`WRITERS`): train a new folder or a train run (its reconcile
then checks the config); an imported model is not trained in place but fine-tuned into a
new workdir with train.init_from, so the import stays a pristine source for several
fine-tunes (and its checkpoint 0 has no data-iterator state to resume from). The sweep
trains its cells through train with the role "sweep-cell", which also takes a finished
sweep run; train-drafter a new folder or a drafter run; report a new folder or a report's
output; import-hf, export-hf and prepare-data only a new or empty folder. A folder of other
files is refused by every command (it is not a run, e.g. `--workdir runs` for
`runs/tiny`). The refusal is one line naming the folder, what it holds, what the command
writes and the command that fits the folder. `READERS` do the same for the folders a
command only reads (a drafter's target, train.init_from, export-hf's source, report's runs).
"""

from __future__ import annotations

import dataclasses
import json
import os

from etils import epath

from v41jax.train import workdir as workdir_lib

LOCK_FILE = ".v41jax.lock"  # `v41jax.train.workdir_lock`: not content, ignored here
SWEEP_FILE, RESULT_FILE, DONE_FILE = "sweep.json", "result.json", "done.json"
REPORT_FILES = ("summary.json", "tables.md", "study3.json")

LABELS = {
    "missing": "nothing (it does not exist)",
    "empty": "an empty folder",
    "file": "a file, not a folder",
    "train_run": "a train run",
    "sweep_cell": "a run a sweep finished",
    "imported": "an imported Hugging Face model",
    "drafter_run": "a drafter run",
    "sweep_runs": "a sweep's runs",
    "report": "a report's output",
    "token_dir": "prepared token files",
    "hf_model": "a Hugging Face model directory",
    "other": "files of no v41jax kind",
}

# The command that fits a folder of each kind ({p}: the folder).
FITS = {
    "train_run": "train --workdir {p} to resume it",
    "sweep_cell": "sweep (the sweep that made it) to continue it",
    "imported": "train --set train.init_from={p} with a new --workdir to fine-tune it",
    "drafter_run": "train-drafter --workdir {p} to resume it",
    "sweep_runs": "sweep --runs-dir {p} to continue it, report --runs-dir {p} to summarise it",
    "report": "report --out-dir {p} to rewrite it",
    "token_dir": "train --set data.token_dir={p} to train on it",
    "hf_model": "import-hf {p} --workdir NEW to import it",
}

EMPTY = frozenset({"missing", "empty"})
# command -> (what it writes, the option naming the folder, the kinds it writes into)
WRITERS = {
    "train": ("train runs", "--workdir", EMPTY | {"train_run"}),
    "sweep-cell": ("its runs' train runs", "--runs-dir", EMPTY | {"train_run", "sweep_cell"}),
    "sweep": ("a sweep's runs", "--runs-dir", EMPTY | {"sweep_runs"}),
    "train-drafter": ("drafter runs", "--workdir", EMPTY | {"drafter_run"}),
    "import-hf": ("a new workdir", "--workdir", EMPTY),
    "export-hf": ("a new Hugging Face model directory", "--out", EMPTY),
    "prepare-data": ("a new token-file folder", "--out", EMPTY),
    "report": ("a report's output", "--out-dir", EMPTY | {"report"}),
}
MODELS = frozenset({"train_run", "sweep_cell", "imported"})
# role -> (the option naming the folder, what it reads, the kinds it reads)
READERS = {
    "target": ("--target-workdir", "a train run or an imported model", MODELS),
    "init-from": ("train.init_from", "a train run or an imported model", MODELS),
    "export-source": ("--workdir", "a train run or an imported model", MODELS),
    "drafter-init": ("--init-from", "a drafter run", frozenset({"drafter_run"})),
    "report-runs": ("--runs-dir", "a sweep's runs", frozenset({"sweep_runs"})),
}


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a folder holds: `name` (a key of LABELS) and the files that told (`evidence`)."""

    name: str
    evidence: str = ""

    def describe(self) -> str:
        label = LABELS[self.name]
        return f"{label} ({self.evidence})" if self.evidence else label


def _read_json(path: epath.Path):
    """The JSON in `path`, or None when it is missing or unreadable (a damaged file is the
    reading command's to report, not the recogniser's)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _imported_checkpoint(folder: epath.Path) -> bool:
    """Whether checkpoint 0's "data" item (orbax's JSON) records `imported_from`."""
    data = _read_json(folder / "checkpoints" / "0" / "data" / "metadata")
    return isinstance(data, dict) and "imported_from" in data


def _holds_runs(folder: epath.Path, names: set[str]) -> str | None:
    """'<study>/<run>/config.json' (or result.json) when a subfolder two levels down holds a
    run or its result (a sweep's runs dir written without sweep.json, by `run_sweep` called
    from Python, or results copied from one), else None."""
    for study in sorted(names)[:64]:
        sub = folder / study
        if study.startswith(".") or not sub.is_dir():
            continue
        for run in sorted(p.name for p in sub.iterdir())[:256]:
            for name in ("config.json", RESULT_FILE):
                if (sub / run / name).exists():
                    return f"{study}/{run}/{name}"
    return None


def workdir_kind(folder: str | os.PathLike) -> Kind:
    """The kind of thing `folder` (local or any epath URL) holds; reads, never writes."""
    path = workdir_lib.as_path(folder)
    if not path.exists():
        return Kind("missing")
    if not path.is_dir():
        return Kind("file")
    names = {p.name for p in path.iterdir()} - {LOCK_FILE}
    if not names:
        return Kind("empty")
    if "drafter.json" in names:
        return Kind("drafter_run", "drafter.json")
    if SWEEP_FILE in names:
        return Kind("sweep_runs", SWEEP_FILE)
    if "manifest.json" in names:
        return Kind("token_dir", "manifest.json")
    if "v41jax_export.json" in names:
        return Kind("hf_model", "v41jax_export.json")
    if "config.json" in names:
        config = _read_json(path / "config.json")
        weights = any(
            n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names
        )
        hf = isinstance(config, dict) and ("model_type" in config or "architectures" in config)
        if hf or (config is None and weights):
            return Kind("hf_model", "config.json + safetensors" if weights else "config.json")
        if markers := sorted(names & {RESULT_FILE, DONE_FILE}):
            return Kind("sweep_cell", " + ".join(["config.json", *markers]))
        if "checkpoints" in names and _imported_checkpoint(path):
            return Kind("imported", "checkpoint 0 records imported_from")
        return Kind(
            "train_run", "config.json + checkpoints/" if "checkpoints" in names else "config.json"
        )
    if found := sorted(names & set(REPORT_FILES)):
        return Kind("report", ", ".join(found))
    if runs := _holds_runs(path, names):
        return Kind("sweep_runs", runs)
    shown = sorted(names)
    return Kind("other", ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else ""))


def _fits(kind: Kind, text: str, joint: str) -> str:
    """`joint` + the command that fits a folder of `kind`, or "" when none does."""
    hint = FITS.get(kind.name)
    return f"{joint}{hint.format(p=text)}" if hint else ""


def require_kind(folder: str | os.PathLike, role: str) -> Kind:
    """The kind of `folder` when `role` (a key of WRITERS or READERS) takes it; otherwise a
    one-line error naming the folder, what it holds and the command that fits it:
    FileNotFoundError for a missing folder a reader needs, ValueError for the rest."""
    text = os.fspath(folder)
    kind = workdir_kind(folder)
    if role in WRITERS:
        writes, flag, accepted = WRITERS[role]
        if kind.name in accepted:
            return kind
        command = "sweep" if role == "sweep-cell" else role
        holds = (
            "is a file, not a folder"
            if kind.name == "file"
            else (f"already holds {kind.describe()}")
        )
        raise ValueError(
            f"{text} {holds}: {command} writes {writes}; use a new {flag}"
            f"{_fits(kind, text, ', or ')}"
        )
    flag, reads, accepted = READERS[role]
    if kind.name in accepted:
        return kind
    if kind.name == "missing":
        raise FileNotFoundError(f"{flag} {text} holds no run (it does not exist)")
    raise ValueError(
        f"{flag} {text} holds {kind.describe()}, not {reads}{_fits(kind, text, '; use ')}"
    )
