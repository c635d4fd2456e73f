"""Frozen-backbone drafter training (`python -m v41jax train-drafter --target-workdir T ...`).

WORKDIR layout (resumable like `train`: the same command continues a killed run)
    drafter.json       DrafterRunConfig + the target it was trained against: its path
                       (relative to this workdir), step and `run_identity` hash, which every
                       later use checks (a rerun must match; a moved target may be named)
    checkpoints/<step> orbax: {params, opt_state} of the drafter only + data-iterator state
    metrics.jsonl      train steps and evals (loss, ce, conf_bce, accept_k, conf_k per position)
    tensorboard/       the same records as TensorBoard scalars
    eval.json          the final evaluation

The optimizer, its schedule, the state's creation and the step loop are the training
stack's (`v41jax.dspark.train_state`, `v41jax.train.steploop`): the state lives on the
target's mesh in the shardings of its logical annotations, each batch is split over the
mesh's data x fsdp axes (train.batch_size must divide), each process reads only its rows,
and a stop on SIGTERM is agreed by every process (`v41jax.train.preemption`).

Only the drafter's parameters are in the optimizer; the target's params enter the step as
arguments under stop_gradient, so the backbone is bit-identical after training (tested).
Realignment: `--target-workdir` may name a target trained further than the one the drafter
started from (`--init-from` a previous drafter workdir): the drafter keeps training against
the new target, with no gradient into it.
The batch at step s is a pure function of (seed, s), as are its anchors, so resume is exact.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.dspark.config import DrafterRunConfig, override_run_config
from v41jax.dspark.model.drafter import frozen_target
from v41jax.dspark.objective import drafter_loss, eval_metrics, sample_anchors, target_features
from v41jax.dspark.train_state import (
    drafter_optimizer,
    drafter_state_fns,
    drafter_variables,
    restore_drafter_state,
)
from v41jax.train import load_run, run_identity
from v41jax.train.checkpoint import Checkpointer

CONFIG_FILE = "drafter.json"


def check_record(workdir: str, record: dict) -> bool:
    """False for a new run; True for a resumable one; ValueError for a different one. The
    target's path may differ (a moved target) when its identity and step agree."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return False
    old = config_lib.read_json(path)
    # settings added since the run was made read as their defaults
    old["config"] = config_lib.to_dict(config_lib.from_dict(DrafterRunConfig, old["config"]))
    ignored = ["target_workdir", "init_from"]  # init_from only seeds step 0
    if "target_identity" not in old:  # recorded before identities: the path must agree
        ignored.append("target_identity")
        if os.path.abspath(recorded_target(workdir, old)) != os.path.abspath(
            os.path.join(workdir, record["target_workdir"])
        ):
            raise ValueError(
                f"workdir {workdir} holds a drafter run of the target "
                f"{recorded_target(workdir, old)}, not {record['target_workdir']}"
            )
    diffs = config_lib.diff(
        {k: v for k, v in old.items() if k not in ignored},
        {k: v for k, v in record.items() if k not in ignored},
    )
    if diffs:
        raise ValueError(
            f"workdir {workdir} holds a drafter run with different settings "
            f"({'; '.join(diffs)}); use a new --workdir, or the original settings to resume"
        )
    return True


def write_record(workdir: str, record: dict) -> None:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    with open(f"{path}.tmp", "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(f"{path}.tmp", path)


def relative_to_workdir(path: str, workdir: str) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.abspath(workdir))


def recorded_target(workdir: str, record: dict) -> str:
    """The target workdir a drafter run records (relative to the drafter's workdir; older
    runs recorded an absolute path)."""
    return os.path.normpath(os.path.join(workdir, record["target_workdir"]))


def check_target(workdir: str, record: dict, target) -> None:
    """ValueError unless `target` (a LoadedRun) is the model the drafter was trained for;
    a note on stderr when it has trained further since (realignment may help)."""
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


def load_record(workdir: str) -> dict:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir} holds no drafter run (no {CONFIG_FILE})")
    return config_lib.read_json(path)


def load_drafter_config(workdir: str) -> tuple[DrafterRunConfig, dict]:
    """(the run's config, its JSON record: target_workdir, target_step, ...)."""
    record = load_record(workdir)
    return config_lib.from_dict(DrafterRunConfig, record["config"]), record


def init_drafter_params(cfg: DrafterRunConfig, target_cfg, frozen, seed: int):
    """Initial drafter params (plain tree) for a target of `target_cfg`."""
    variables = drafter_variables(cfg, target_cfg, frozen, jax.random.key(seed))
    return nn.unbox(variables["params"])


def make_update(cfg: DrafterRunConfig, target_cfg, optimizer, state_shardings=None, mesh=None):
    """Jitted update(state, frozen, feats, logits, batch, anchors) -> (state, metrics): one
    `optimizer` step of the drafter on a frozen-target pass's features and logits
    (`target_features`); the new state in `state_shardings` on `mesh` when given
    (`drafter_state_fns`), the metrics replicated."""
    loss_fn = functools.partial(
        drafter_loss, drafter=cfg.drafter, target_cfg=target_cfg, train=cfg.train
    )
    out = None if state_shardings is None else (state_shardings, sharding.replicated(mesh))

    def update(state, frozen, feats, logits, batch, anchors):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(state["params"], frozen, feats, logits, batch, anchors)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return {"params": params, "opt_state": opt_state}, metrics

    return jax.jit(update) if out is None else jax.jit(update, out_shardings=out)


def make_train_step(cfg: DrafterRunConfig, target_cfg, layer_ids, params):
    """(optimizer, step(state, target_params, frozen, batch, anchors)): the frozen-target
    pass then `make_update`'s step, for one drafter with `params`' tree."""
    optimizer = drafter_optimizer(cfg, params)
    update = make_update(cfg, target_cfg, optimizer)
    features = jax.jit(functools.partial(target_features, target_cfg=target_cfg,
                                         layer_ids=tuple(layer_ids)))  # fmt: skip

    def step(state, target_params, frozen, batch, anchors):
        feats, logits = features(target_params, batch=batch)
        return update(state, frozen, feats, logits, batch, anchors)

    return optimizer, step


def anchors_at(seed: int, step: int, batch_size: int, seq_len: int, n: int) -> np.ndarray:
    return sample_anchors(np.random.default_rng([seed, step]), batch_size, seq_len, n)


def flat_metrics(metrics: dict) -> dict:
    out = {}
    for name, value in metrics.items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[name] = float(value)
        else:  # per draft position: accept_1 .. accept_K
            out.update({f"{name}_{i + 1}": float(v) for i, v in enumerate(value)})
    return out


def evaluate_drafter(cfg, target, frozen, params, batches, layer_ids) -> dict:
    """Mean metrics over fixed validation batches with fixed anchors (seeded by batch index)."""
    sums: dict[str, float] = {}
    for i, batch in enumerate(batches):
        b, t = batch["inputs"].shape
        anchors = jnp.asarray(anchors_at(10**6, i, b, t, cfg.train.anchors_per_seq))
        m = eval_metrics(
            params,
            target.params,
            frozen,
            batch,
            anchors,
            drafter=cfg.drafter,
            target_cfg=target.cfg.model,
            train=cfg.train,
            layer_ids=layer_ids,
        )
        for name, v in flat_metrics(m).items():
            sums[name] = sums.get(name, 0.0) + v / len(batches)
    return {f"val_{k}": v for k, v in sums.items()}


def train_drafter(
    cfg: DrafterRunConfig,
    target_workdir: str,
    workdir: str,
    *,
    init_from: str | None = None,
    progress: bool = True,
) -> dict:
    """Train (or resume) the drafter in `workdir` against the target in `target_workdir`:
    `train_shared.train_drafters` with this one drafter (one loop for one or many).

    Every check runs before the first write, so a refused command (missing target, other
    settings, bad layer ids) leaves `workdir` as it was (not even created)."""
    from v41jax.dspark.train_shared import train_drafters  # it builds on this module

    init = {workdir: init_from} if init_from else None
    return train_drafters({workdir: cfg}, target_workdir, init_from=init, progress=progress)[
        workdir
    ]


def load_drafter(workdir: str, step: int | None = None, *, target=None, check: bool = True):
    """(DrafterRunConfig, drafter params, record) of checkpoint `step`, or by default the
    newest one that reads (as `load_run`: a damaged newer one is named on stderr and left in
    place; record["step"] says which step this is). A damaged `step` asked for by number is
    a `DamagedCheckpointError` naming it.

    target: the target run (a LoadedRun) to use it with; default the one the run records.
    It must be the model the drafter was trained for (`check_target`): its shapes define the
    drafter's."""
    cfg, record = load_drafter_config(workdir)
    if target is None:
        target = load_run(recorded_target(workdir, record))
    if check:
        check_target(workdir, record, target)
    frozen = frozen_target(target.params, target.cfg.model)
    _, _, _, abstract = drafter_state_fns(cfg, target.cfg.model, frozen, target.mesh)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.train.keep_checkpoints)
    try:  # read-only, as `load_run`: a damaged newest step is named and left in place
        if step is not None and step not in (have := ckpt.all_steps()):
            raise FileNotFoundError(
                f"no drafter checkpoint of step {step} in {ckpt.directory} (have {have})"
            )
        found = ckpt.restore_newest_intact(
            lambda s: restore_drafter_state(ckpt, s, abstract, cfg)[0],
            set_aside=False,
            steps=None if step is None else [step],
            quiet=jax.process_index() != 0,
        )
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(
            f"no drafter checkpoints in {ckpt.directory}: train the drafter first"
        )
    step, restored = found
    return cfg, restored["params"], {**record, "step": step}


def with_overrides(cfg: DrafterRunConfig, overrides: list[str]) -> DrafterRunConfig:
    return override_run_config(cfg, overrides) if overrides else dataclasses.replace(cfg)
