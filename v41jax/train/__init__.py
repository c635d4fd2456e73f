"""Training: optimizer groups, sharded train state, jitted steps, checkpoints, the loop."""

from v41jax.train.loop import LoadedRun, evaluate_run, load_run, train
from v41jax.train.optimizer import lr_schedule, make_optimizer, param_group_labels
from v41jax.train.resume import run_identity
from v41jax.train.step import next_token_loss

__all__ = [
    "LoadedRun",
    "evaluate_run",
    "load_run",
    "lr_schedule",
    "make_optimizer",
    "next_token_loss",
    "param_group_labels",
    "run_identity",
    "train",
]
