"""AdamW with warmup + cosine, global-norm clipping, and per-group hyperparameters.

Parameter groups (`OptimConfig.param_groups`) are matched on the '/'-joined param path, first
match wins, the rest are "default". Each group is its own AdamW inside `optax.multi_transform`,
so a group (Engram tables: Adam at 5x LR, no weight decay) gets its own LR scale and decay
without touching the others. Clipping is by the global norm over ALL groups, applied before the
split, as a single-optimizer run would.

Schedule (step s, warmup W, length S = optim.schedule_steps or train.steps, peak lr, floor
r*lr; past S the rate stays at the floor):
    lr(s) = lr * s / W                                           for s < W
    lr(s) = r*lr + (1 - r)*lr * (1 + cos(pi * (s - W)/(S - W))) / 2    otherwise
"""

from __future__ import annotations

import re

import jax
import optax
from flax import traverse_util

from v41jax.config import Config, OptimConfig, ParamGroup
from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balanced_momentum

DEFAULT_GROUP = "default"


def schedule_length(cfg: Config) -> int:
    """S, the learning-rate schedule's length: optim.schedule_steps, or train.steps if 0."""
    return cfg.optim.schedule_steps or cfg.train.steps


def lr_schedule(cfg: OptimConfig, total_steps: int, lr_scale: float = 1.0) -> optax.Schedule:
    peak = cfg.lr * lr_scale
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=peak * cfg.min_lr_ratio,
    )


def param_group_labels(params, groups: tuple[ParamGroup, ...]):
    """Tree of group names, one per leaf of `params` (plain or boxed tree)."""
    compiled = [(g.name, re.compile(g.pattern)) for g in groups]
    names = [g.name for g in groups]
    if DEFAULT_GROUP in names or len(set(names)) != len(names):
        raise ValueError(
            f"optim.param_groups names must be unique and not {DEFAULT_GROUP!r}: {names}"
        )

    def label(path: tuple) -> str:
        key = "/".join(str(p) for p in path)
        for name, pattern in compiled:
            if pattern.search(key):
                return name
        return DEFAULT_GROUP

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: label(path) for path in flat})


def make_optimizer(cfg: OptimConfig, total_steps: int, params) -> optax.GradientTransformation:
    """The full update rule for `params` (used only for its tree structure and paths)."""
    labels = param_group_labels(params, cfg.param_groups)
    group_cfg = {g.name: g for g in cfg.param_groups}
    used = set(jax.tree.leaves(labels))

    def adamw(name: str) -> optax.GradientTransformation:
        g = group_cfg.get(name)
        scale = g.lr_scale if g else 1.0
        wd = cfg.weight_decay if g is None or g.weight_decay is None else g.weight_decay
        if g is not None and g.rule == "sinkhorn":  # balanced momentum, unit RMS, x gamma
            return optax.chain(
                sinkhorn_balanced_momentum(g.momentum),
                optax.add_decayed_weights(wd),
                optax.scale_by_learning_rate(lr_schedule(cfg, total_steps, scale * SINKHORN_GAMMA)),
            )
        return optax.adamw(
            lr_schedule(cfg, total_steps, scale),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=wd,
        )

    transforms = {name: adamw(name) for name in sorted(used)}
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    chain.append(optax.multi_transform(transforms, labels))
    return optax.chain(*chain)


def module_norms(prefix: str, tree: dict) -> dict:
    """{"<prefix>/<module>": global L2 norm} per top-level entry of a params-shaped tree
    (embed, block_<i> / layers_<a>_<b> runs, final_norm, head)."""
    return {f"{prefix}/{name}": optax.tree.norm(sub) for name, sub in tree.items()}
