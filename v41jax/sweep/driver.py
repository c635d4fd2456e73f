"""The sweep driver: a grid of training runs, each in its own resumable workdir.

A sweep file is a Python file with `get_sweep(setting: str = "full") -> list[RunSpec]` (and,
optionally, `SETTINGS`, the settings it knows). Run `s` trains in
`<runs_dir>/<study>/<arm>_seed<seed>` with `v41jax.train.train`, which writes metrics.jsonl
and resumes from the last checkpoint. A finished run has, besides the final checkpoint,

    result.json   val_loss, tokens_seen, wall_s, step_s and the parameter / FLOP accounting
    analysis_<name>.json   one per `RunSpec.eval_only_analysis` entry (v41jax.sweep.analysis)
    done.json     the done marker (written last): the final evaluation

and is skipped by a rerun; a killed sweep continues at the first run without done.json (that
run resumes from its own last checkpoint). A finished run whose config.json differs from the
spec is an error: change the grid and the runs dir together.

Timing from metrics.jsonl alone (so it sums over resumes): a train line logged at step s with
`tokens_per_s` r after the previous line at step p covers `(s - p) * tokens_per_step / r`
seconds. `wall_s` is their sum (compilation, periodic evals and checkpoints included);
`step_s` the median seconds per step over those intervals, which drops the compile-heavy
first interval of each (re)start.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from tqdm.auto import tqdm

from v41jax import config as config_lib
from v41jax.config import Config, ModelConfig
from v41jax.engram import EngramConfig, size_tables_for_budget
from v41jax.model.accounting import param_accounting
from v41jax.sweep.analysis import ANALYSES, run_analysis
from v41jax.train import train
from v41jax.train.metrics import read_metrics
from v41jax.train.workdir_kind import require_kind
from v41jax.train.workdir_lock import check_unlocked, workdir_lock

RESULT_FILE, DONE_FILE = "result.json", "done.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")


@dataclass(frozen=True)
class RunSpec:
    """One training run of a sweep.

    study, arm: names (letters, digits, `_.+=-`); the workdir is `<study>/<arm>_seed<seed>`.
    seed: the run's seed; `cfg.train.seed` must equal it (so labels cannot lie).
    cfg: the full config of the run.
    eval_only_analysis: post-training analyses (names in `analysis.ANALYSES`), e.g.
        ("engram_off",): validation loss with Engram switched off, split by token type.
    meta: JSON-able facts the report groups by (e.g. {"kind": "ffn", "p_added": 2e6}).
    """

    study: str
    arm: str
    seed: int
    cfg: Config
    eval_only_analysis: tuple[str, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        for name in ("study", "arm"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                raise ValueError(f"RunSpec.{name}={value!r}: use letters, digits and _.+=-")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"RunSpec.seed={self.seed!r} must be an int >= 0")
        if not isinstance(self.cfg, Config):
            raise TypeError(f"RunSpec.cfg is a {type(self.cfg).__name__}, expected Config")
        if self.cfg.train.seed != self.seed:
            raise ValueError(
                f"RunSpec {self.name}: cfg.train.seed={self.cfg.train.seed} != seed={self.seed}"
            )
        unknown = set(self.eval_only_analysis) - set(ANALYSES)
        if unknown:
            raise ValueError(
                f"RunSpec {self.name}: eval_only_analysis {sorted(unknown)} unknown; "
                f"known: {list(ANALYSES)}"
            )
        json.dumps(dict(self.meta))  # fails early, naming the value, if meta is not JSON-able

    @property
    def name(self) -> str:
        return f"{self.study}/{self.arm}_seed{self.seed}"

    def workdir(self, runs_dir: str) -> str:
        return os.path.join(runs_dir, self.study, f"{self.arm}_seed{self.seed}")


# ----------------------------------------------------------------------------- sweep files


def git_commit(path: str) -> str:
    """The short commit hash of the checkout holding `path` ("unknown" outside git), which
    experiments record beside their results."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path,
                             capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def experiment_module(experiment_dir: str, name: str):
    """Module `<experiment_dir>/<name>.py` (an experiment's config.py or report.py), loaded under
    the name `<experiment dir's basename>_<name>`.

    Experiments each have their own config.py and report.py; `sys.path.insert(dir)` followed by
    `import config` hands the second experiment imported in one process the first one's config
    (the name `config` is already in sys.modules). Loading by path under a distinct name keeps
    them apart. Loaded once per process, like an import."""
    path = os.path.join(experiment_dir, f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"experiment module {path!r} does not exist")
    module_name = f"{os.path.basename(os.path.abspath(experiment_dir))}_{name}"
    module = sys.modules.get(module_name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "")) == os.path.abspath(
        path
    ):
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses defined in the file look their module up here
    spec.loader.exec_module(module)
    return module


def load_sweep(
    path: str, setting: str = "full", overrides: list[str] | None = None
) -> list[RunSpec]:
    """The RunSpecs of sweep file `path` at `setting`, each cfg with `--set` overrides applied
    (meant for data.*, train.* and mesh.* fields; model fields would undo the grid's
    parameter matching)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sweep file {path!r} does not exist")
    name = f"_v41jax_sweep_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses defined in the file look their module up here
    spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"sweep file {path!r} has no get_sweep(setting) function")
    known = getattr(module, "SETTINGS", None)
    if known is not None and setting not in known:
        raise ValueError(f"unknown setting {setting!r} for {path}; settings: {list(known)}")
    specs = list(module.get_sweep(setting))
    if not specs:
        raise ValueError(f"{path}: get_sweep({setting!r}) returned no runs")
    bad = [type(s).__name__ for s in specs if not isinstance(s, RunSpec)]
    if bad:
        raise ValueError(f"{path}: get_sweep({setting!r}) returned {bad[:3]}, expected RunSpec")
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: runs {repeated} appear more than once")
    if overrides:
        specs = [dataclasses.replace(s, cfg=config_lib.override(s.cfg, overrides)) for s in specs]
    return specs


SWEEP_FILE = "sweep.json"  # in a runs dir: which sweep file and setting its runs are


def default_runs_dir(experiment: str, setting: str = "full") -> str:
    """`runs/<experiment folder name>` for a sweep file or experiment folder path, with
    `_<setting>` appended for any setting but "full" (a mini sweep never mixes with it)."""
    folder = os.path.dirname(experiment) if experiment.endswith(".py") else experiment
    name = os.path.basename(os.path.abspath(folder))
    return os.path.join("runs", name if setting == "full" else f"{name}_{setting}")


def experiment_dirs(
    experiment_dir: str, setting: str, runs_dir: str | None = None, out_dir: str | None = None
) -> tuple[str, str]:
    """(runs dir, results dir) of an experiment at `setting`, the given ones first.

    Only the "full" setting writes the experiment's committed `results/` by default; any
    other (mini, quick) writes `<runs dir>/results`, so a miniature never overwrites them."""
    runs_dir = runs_dir or default_runs_dir(experiment_dir, setting)
    default_out = os.path.join(experiment_dir if setting == "full" else runs_dir, "results")
    return runs_dir, out_dir or default_out


def record_setting(runs_dir: str, sweep_file: str, setting: str) -> None:
    """Write (or check) `<runs_dir>/sweep.json`: a runs dir holds the runs of one setting.
    `runs_dir` must be new, empty or a sweep's runs (`v41jax.train.workdir_kind`)."""
    require_kind(runs_dir, "sweep")
    path = os.path.join(runs_dir, SWEEP_FILE)
    record = {"sweep_file": os.path.basename(sweep_file), "setting": setting}
    if os.path.exists(path):
        old = config_lib.read_json(path)
        if old.get("setting") != setting:
            raise ValueError(
                f"{runs_dir} holds the runs of setting {old.get('setting')!r}, not {setting!r}; "
                "use another --runs-dir"
            )
        return
    os.makedirs(runs_dir, exist_ok=True)
    _write_json(path, record)


def recorded_setting(runs_dir: str) -> str | None:
    """The setting `record_setting` wrote for `runs_dir` (None when none was recorded)."""
    path = os.path.join(runs_dir, SWEEP_FILE)
    if not os.path.exists(path):
        return None
    return config_lib.read_json(path).get("setting")


# ----------------------------------------------------------------------------- accounting


def accounting(cfg: Config) -> dict[str, int | float]:
    """`param_accounting` of the model, FLOPs at the training sequence length."""
    return param_accounting(cfg.model, seq_len=cfg.data.seq_len)


def total_params(model: ModelConfig) -> int:
    return int(param_accounting(model)["total_params"])


def ffn_width_for(base: ModelConfig, extra_params: int) -> int:
    """The d_ff whose model has total params closest to `total(base) + extra_params`.

    SwiGLU params are affine in d_ff (3 * D per unit per dense layer), so one finite
    difference gives the slope; the two integers around the solution are compared by the
    real count (ties: the narrower).
    """
    if extra_params < 0:
        raise ValueError(f"ffn_width_for: extra_params={extra_params} must be >= 0")
    t0 = total_params(base)
    slope = total_params(dataclasses.replace(base, d_ff=base.d_ff + 1)) - t0
    if slope <= 0:
        raise ValueError(f"ffn_width_for: d_ff adds no params to this model (slope {slope})")
    guess = base.d_ff + extra_params / slope
    candidates = sorted({max(1, int(guess)), max(1, int(guess) + 1)})

    def miss(d_ff: int) -> int:
        return abs(total_params(dataclasses.replace(base, d_ff=d_ff)) - t0 - extra_params)

    return min(candidates, key=lambda d: (miss(d), d))


def engram_for_budget(model: ModelConfig, engram: EngramConfig, extra_params: int):
    """`engram` with tables sized so its params (tables + projections) are ~extra_params."""
    branches = max(model.mhc.n_streams, 1)
    return size_tables_for_budget(engram, model.d_model, int(extra_params), branches)


# ----------------------------------------------------------------------------- results


def train_timing(rows: list[dict], tokens_per_step: int) -> dict[str, float]:
    """wall_s and step_s from metrics.jsonl rows (module docstring)."""
    wall, per_step, prev = 0.0, [], 0
    for r in rows:
        if "tokens_per_s" not in r or r["step"] <= prev:
            continue
        steps = r["step"] - prev
        dt = steps * tokens_per_step / r["tokens_per_s"]
        wall += dt
        per_step.append(dt / steps)
        prev = r["step"]
    step_s = statistics.median(per_step[1:] or per_step) if per_step else float("nan")
    return {"wall_s": wall, "step_s": step_s}


def _final_train_metrics(rows: list[dict]) -> dict[str, float]:
    """The last train line's loss and routing stats (MoE drops are reported, not hidden)."""
    train_rows = [r for r in rows if "loss" in r]
    if not train_rows:
        return {}
    keep = ("loss", "moe_aux_loss", "moe_dropped_fraction", "moe_max_load")
    out = {f"final_{k}": train_rows[-1][k] for k in keep if k in train_rows[-1]}
    drops = [r["moe_dropped_fraction"] for r in train_rows if "moe_dropped_fraction" in r]
    if drops:
        out["mean_moe_dropped_fraction"] = sum(drops) / len(drops)
    return out


def write_result(spec: RunSpec, workdir: str, final_eval: dict) -> dict:
    """Write and return `<workdir>/result.json` from the final eval and metrics.jsonl."""
    cfg = spec.cfg
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    result = {
        "study": spec.study,
        "arm": spec.arm,
        "seed": spec.seed,
        "meta": dict(spec.meta),
        "eval_only_analysis": list(spec.eval_only_analysis),
        "step": final_eval["step"],
        "val_loss": final_eval["val_loss"],
        "val_tokens": final_eval.get("val_tokens"),
        "tokens_seen": final_eval["step"] * tokens_per_step,
        **train_timing(rows, tokens_per_step),
        **_final_train_metrics(rows),
        "accounting": accounting(cfg),
    }
    _write_json(os.path.join(workdir, RESULT_FILE), result)
    return result


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)  # atomic: a kill never leaves half a marker


def check_workdir_config(spec: RunSpec, workdir: str, writing: bool = True) -> None:
    """Raise ValueError if `workdir` holds a run of a different config than `spec`, or
    anything but a train run (`v41jax.train.workdir_kind`: a drafter run, token files, ...);
    when `writing`, also `WorkdirLocked` if another process is writing it (read-only checks,
    so a sweep refuses before it writes anything, sweep.json included)."""
    require_kind(workdir, "sweep-cell")
    if writing:
        check_unlocked(workdir)
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return
    saved, cfg = config_lib.load_json(path), spec.cfg
    engram = cfg.model.engram
    if engram.compressed_vocab_size == 0:  # filled from the data by train(): not a difference
        engram = dataclasses.replace(
            engram, compressed_vocab_size=saved.model.engram.compressed_vocab_size
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engram=engram))
    diffs = config_lib.diff(saved, cfg)
    if diffs:
        raise ValueError(
            f"run {spec.name} in {workdir} was trained with a different config "
            f"({'; '.join(diffs)}); use another --runs-dir or remove that workdir"
        )


def is_done(spec: RunSpec, workdir: str) -> bool:
    """Finished: done marker, result.json and the final checkpoint, with the same config."""
    if not os.path.exists(os.path.join(workdir, DONE_FILE)):
        return False
    check_workdir_config(spec, workdir, writing=False)
    final_ckpt = os.path.join(workdir, "checkpoints", str(spec.cfg.train.steps))
    if not os.path.isdir(final_ckpt) or not os.path.exists(os.path.join(workdir, RESULT_FILE)):
        return False
    for name in (DONE_FILE, RESULT_FILE):  # a damaged one is named, not taken for done
        config_lib.read_json(os.path.join(workdir, name))
    return True


def run_one(spec: RunSpec, runs_dir: str, *, progress: bool = True) -> dict | None:
    """Train (or resume) one run, then result.json, its analyses and the done marker, all
    while holding the run's workdir lock (`v41jax.train.workdir_lock`; train takes it again,
    re-entrantly). Returns the result, or None when a signal stopped training (checkpoint
    saved)."""
    workdir = spec.workdir(runs_dir)
    check_workdir_config(spec, workdir)
    with workdir_lock(workdir, "sweep"):
        final_eval = train(spec.cfg, workdir, progress=progress, role="sweep-cell")
        if final_eval.get("stopped"):
            return None
        result = write_result(spec, workdir, final_eval)
        for name in spec.eval_only_analysis:
            run_analysis(name, workdir)
        done = {"eval": final_eval, "finished": time.time()}
        _write_json(os.path.join(workdir, DONE_FILE), done)
    return result


def run_sweep(
    specs: list[RunSpec], runs_dir: str, *, progress: bool = True, limit: int | None = None
) -> dict:
    """Run `specs` in order, skipping finished ones; stop after `limit` trained runs.

    Returns {"trained": [names], "skipped": [names], "stopped": bool, "pending": [names]}.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    require_kind(runs_dir, "sweep")
    for spec in specs:  # refuse a conflicting run dir before training anything
        check_workdir_config(spec, spec.workdir(runs_dir))
    out: dict = {"trained": [], "skipped": [], "stopped": False, "pending": []}
    with tqdm(total=len(specs), desc="sweep", unit="run", disable=not progress) as bar:
        for spec in specs:
            bar.set_postfix_str(spec.name)
            if is_done(spec, spec.workdir(runs_dir)):
                out["skipped"].append(spec.name)
            elif out["stopped"] or (limit is not None and len(out["trained"]) >= limit):
                out["pending"].append(spec.name)
                continue
            elif run_one(spec, runs_dir, progress=progress) is None:
                out["stopped"] = True
                out["pending"].append(spec.name)
                continue
            else:
                out["trained"].append(spec.name)
                # each run compiles its own programs; drop them so a long sweep's memory
                # does not grow with the number of configs
                jax.clear_caches()
            bar.update(1)
    return out
