"""Sweeps: a grid of resumable training runs (driver), its report (tables, plots, summary.json)
and post-training analyses (Engram switched off, losses by token type).

A layer above `train`: it imports config, data, engram, model and train; only the CLI and
experiments import it.
"""

from v41jax.sweep.analysis import (
    ANALYSES,
    BigramCounts,
    analyze_run,
    engram_off_params,
    run_analysis,
    strip_engram,
    token_losses,
    token_type_masks,
)
from v41jax.sweep.driver import (
    RunSpec,
    accounting,
    default_runs_dir,
    engram_for_budget,
    experiment_dirs,
    experiment_module,
    ffn_width_for,
    git_commit,
    is_done,
    load_sweep,
    record_setting,
    recorded_setting,
    run_sweep,
    total_params,
)
from v41jax.sweep.report import collect_runs, write_report

__all__ = [
    "ANALYSES",
    "BigramCounts",
    "RunSpec",
    "accounting",
    "analyze_run",
    "collect_runs",
    "default_runs_dir",
    "engram_for_budget",
    "engram_off_params",
    "experiment_dirs",
    "experiment_module",
    "ffn_width_for",
    "git_commit",
    "is_done",
    "load_sweep",
    "record_setting",
    "recorded_setting",
    "run_analysis",
    "run_sweep",
    "strip_engram",
    "token_losses",
    "token_type_masks",
    "total_params",
    "write_report",
]
