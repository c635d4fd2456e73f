"""What a rerun in an existing workdir may change, and the read-only look at that workdir.

A workdir's `config.json` is the run's contract: the same command resumes it. A rerun may
change only the fields that leave the steps already trained as they were:

    train.steps             raised (or lowered, not below the latest checkpoint). The
                            learning-rate schedule keeps the length the trained steps used:
                            optim.schedule_steps is set to it, so steps past it run at the
                            schedule's floor rate instead of rewinding the cosine.
    train.log_every, eval_every, eval_batches, checkpoint_every, keep_checkpoints
    generate.*, name        bookkeeping and sampling defaults
    model.scan_layers, remat_policy, attention_impl, attention_block_size
                            how the same params are computed (a checkpoint of the other
                            layer layout is converted on restore)

Everything else (data, model shapes, optimizer, seeds, mesh) is refused with the list of
differences, before anything in the workdir is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import orbax.checkpoint as ocp

from v41jax import config as config_lib
from v41jax.config import Config
from v41jax.train import workdir as workdir_lib

# Model fields that change how params are used, not which params exist: a resumed run, or one
# fine-tuned with train.init_from, may set them differently from the run it continues.
COMPUTE_ONLY_MODEL_FIELDS = (
    "scan_layers",
    "remat_policy",
    "attention_impl",
    "attention_block_size",
    "logits_chunk",
)

RESUMABLE_FIELDS = (
    "name",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.microbatches",
    "train.async_checkpoints",
    "train.profile_steps",
    "train.peak_flops",
    "train.tensorboard",
    "train.stop_check_every",
    "train.compilation_cache",
    # the same tokens from files (prepare-data) or tokenized in memory: the token dir's
    # manifest must match the data config (load_token_dir), and the batches are equal
    "data.token_dir",
    "optim.schedule_steps",  # checked through the schedule's effective length
    *(f"model.{k}" for k in COMPUTE_ONLY_MODEL_FIELDS),
)
RESUMABLE_SECTIONS = ("generate.",)


def latest_checkpoint_step(workdir: str | os.PathLike) -> int | None:
    """The newest complete checkpoint's step in `workdir/checkpoints` (any epath path), read
    without creating anything. Complete as orbax decides it: a local step is written under a
    temporary name and renamed when done, a GCS step carries a commit marker."""
    directory = workdir_lib.as_path(workdir) / "checkpoints"
    if not directory.is_dir():
        return None
    steps = ocp.path.step.checkpoint_steps(directory)
    return max(steps) if steps else None


def saved_config(workdir: str | os.PathLike) -> Config | None:
    path = workdir_lib.as_path(workdir) / "config.json"
    return workdir_lib.load_config(path) if path.exists() else None


def _is_resumable(change: str) -> bool:
    key = change.split(":", 1)[0]
    return key in RESUMABLE_FIELDS or key.startswith(RESUMABLE_SECTIONS)


def reconcile(saved: Config, new: Config, latest_step: int | None, workdir: str):
    """(the config to continue with, the changes it makes to `saved`, one line each).

    Raises ValueError naming every difference that would change the steps already trained,
    and a train.steps below the latest checkpoint.
    """
    trained_length = saved.optim.schedule_steps or saved.train.steps
    notes = []
    if (
        latest_step is not None
        and new.optim.schedule_steps == 0
        and new.train.steps != trained_length
    ):
        # keep the schedule of the steps already taken; the extra steps run at its floor
        new = dataclasses.replace(
            new, optim=dataclasses.replace(new.optim, schedule_steps=trained_length)
        )
        notes.append(
            f"optim.schedule_steps kept at {trained_length} (the schedule the trained steps "
            f"used; steps after {trained_length} run at lr x optim.min_lr_ratio)"
        )
    changes = config_lib.diff(saved, new)
    new_length = new.optim.schedule_steps or new.train.steps
    refused = [c for c in changes if not _is_resumable(c)]
    if latest_step is not None and new_length != trained_length:
        refused.append(
            f"learning-rate schedule length {trained_length} -> {new_length} "
            "(optim.schedule_steps or train.steps): it would change the steps already trained"
        )
    if refused:
        raise ValueError(
            f"workdir {workdir} holds a run with a different config ({'; '.join(refused)}); "
            "use a new --workdir, or the original settings to resume (a rerun may change "
            "only train.steps, the logging/eval/checkpoint intervals, generate.* and how "
            "the model is computed: model.scan_layers, remat_policy, attention_impl)"
        )
    if latest_step is not None and new.train.steps < latest_step:
        raise ValueError(
            f"train.steps={new.train.steps} is below the latest checkpoint of {workdir} "
            f"(step {latest_step}); the run has already trained past it"
        )
    shown = [c for c in changes if not c.startswith("optim.schedule_steps")]
    return new, shown + notes


# Config fields added after runs were recorded by identity (drafters record their target's):
# at these defaults they are left out of the hash, so such records stay valid. Dotted paths
# from the config's root; "*" stands for every item of a list (the optimizer's groups).
ADDED_FIELDS = {
    "model.attention_bias": False,
    "model.qk_norm": False,
    "model.engram.table_momentum": 0.95,
    "optim.param_groups.*.rule": "adamw",
    "optim.param_groups.*.momentum": 0.95,
    "optim.recipe": "adamw",
    "model.mhc.sinkhorn_newton_steps": 0,  # the value saved configs without it load with
}


def _drop_at_default(node, path: list[str], default) -> None:
    """Delete `path` under `node` (dicts, and lists where the path says "*") where it holds
    `default`; paths that are absent are left alone."""
    head, *rest = path
    if head == "*":
        for item in node if isinstance(node, list) else ():
            _drop_at_default(item, rest, default)
    elif isinstance(node, dict) and head in node:
        if rest:
            _drop_at_default(node[head], rest, default)
        elif node[head] == default:
            del node[head]


def run_identity(cfg: Config) -> str:
    """A hash of what defines a run's trained function: its config less the fields a rerun
    may change (RESUMABLE_FIELDS, generate.*) and the mesh. Two workdirs with the same hash
    are the same model trained on the same data, possibly for different numbers of steps (a
    drafter records its target's, `v41jax.dspark.train.record`)."""
    tree = config_lib.to_dict(cfg)
    for key, default in ADDED_FIELDS.items():  # absent from older runs' hashes
        _drop_at_default(tree, key.split("."), default)
    if not cfg.model.mhc.n_streams:  # no mHC: its Sinkhorn polish defines nothing
        tree["model"]["mhc"].pop("sinkhorn_newton_steps", None)
    for key in (*RESUMABLE_FIELDS, "generate", "mesh"):
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node[section]
        node.pop(leaf, None)
    text = json.dumps(tree, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
