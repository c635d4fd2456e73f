"""The update rule: per-group optimizers under one warmup + cosine schedule and one clip.

Parameter groups (`OptimConfig.param_groups`) are matched on the '/'-joined param path, first
match wins, the rest are "default". Each group is its own optimizer inside
`optax.multi_transform`, so a group (Engram tables: Adam at 5x LR, no weight decay) gets its own
rule, LR scale and decay without touching the others. Clipping is by the global norm over ALL
groups, applied before the split, as a single-optimizer run would.

Recipes (`optim.recipe`) decide the rule of the params no group matched:

    adamw   AdamW (b1, b2, eps, weight_decay) for all of them.
    v41     DeepSeek-V4.1's: by each param's role (`v41jax.model.param_role`)
              matrix     Muon: Nesterov momentum (0.95), Newton-Schulz orthogonalised per
                         matrix (`optax.contrib.muon`; Q and K per attention head, a scanned
                         stack per layer, MoE weights per expert), scaled to AdamW's update
                         RMS: x 0.2 sqrt(max(fan_in, fan_out)); decoupled weight_decay
              embedding  the Sinkhorn-balanced update (`sinkhorn_balanced_momentum`: rows =
              head       token ids; the head's are its last axis), lr x gamma (0.18), no decay
              vector     AdamW without weight decay (norms, biases, mHC gates)
              other      AdamW (e.g. the Engram short convolution)
            and a dense Engram table group takes the Sinkhorn-balanced update too
            (`OptimConfig.tables_trained_by`). Muon is optax's (its Newton-Schulz
            coefficients, 5 steps): `optax.contrib.muon` without its Adam half, since the
            recipe's groups already route the non-matrices; the dimension numbers say which
            axes are the matrix.

`optimizer_groups` lists each group's rule, peak learning rate and scaling rule (the trainer
prints it when a run starts).

Schedule (step s, warmup W, length S = optim.schedule_steps or train.steps, peak lr, floor
r*lr; past S the rate stays at the floor):
    lr(s) = lr * s / W                                           for s < W
    lr(s) = r*lr + (1 - r)*lr * (1 + cos(pi * (s - W)/(S - W))) / 2    otherwise
"""

from __future__ import annotations

import math
import re

import jax
import optax
from flax import traverse_util
from optax.contrib import MuonDimensionNumbers

from v41jax.config import Config, OptimConfig, ParamGroup
from v41jax.model import param_role
from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balanced_momentum

DEFAULT_GROUP = "default"
# recipe v41's groups, for the params no configured group matched (module doc)
RECIPE_GROUPS = {
    "matrix": "v41_muon",
    "embedding": "v41_embedding",
    "head": "v41_head",
    "table": "v41_tables",
    "vector": "v41_vectors",
}
RECIPE_MOMENTUM = 0.95  # Muon's and the embedding / head Sinkhorn momentum
MUON_CONSISTENT_RMS = 0.2  # Muon's update scaled to AdamW's RMS (Moonlight)


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


def param_group_labels(params, groups: tuple[ParamGroup, ...], recipe: str = "adamw"):
    """Tree of group names, one per leaf of `params` (plain or boxed tree): the first
    configured group whose pattern matches, else the recipe's group for the leaf's role
    (recipe "v41", RECIPE_GROUPS), else "default"."""
    compiled = [(g.name, re.compile(g.pattern)) for g in groups]
    names = [g.name for g in groups]
    if DEFAULT_GROUP in names or len(set(names)) != len(names):
        raise ValueError(
            f"optim.param_groups names must be unique and not {DEFAULT_GROUP!r}: {names}"
        )
    if reserved := sorted(set(names) & set(RECIPE_GROUPS.values())):
        raise ValueError(f"optim.param_groups names {reserved} are the v41 recipe's own")

    def label(path: tuple, leaf) -> str:
        key = "/".join(str(p) for p in path)
        for name, pattern in compiled:
            if pattern.search(key):
                return name
        if recipe == "v41":
            return RECIPE_GROUPS.get(param_role(path, leaf.shape).role, DEFAULT_GROUP)
        return DEFAULT_GROUP

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: label(path, leaf) for path, leaf in flat.items()})


def _role_at(path, leaf):
    """(the param's keys, its `param_role`) from a tree_map_with_path path (flax's partition
    boxes on the way are skipped)."""
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    return keys, param_role(keys, leaf.shape)


def _muon_dimensions(tree):
    """MuonDimensionNumbers per leaf of a (masked, maybe boxed) params tree of the Muon
    group, from each leaf's role's matrix axes."""

    def dims(path, leaf):
        keys, role = _role_at(path, leaf)
        if role.role != "matrix":
            raise ValueError(f"param {'/'.join(keys)} {leaf.shape} is no matrix: not for Muon")
        return MuonDimensionNumbers(reduction_axis=role.in_axes, output_axis=role.out_axes)

    return jax.tree_util.tree_map_with_path(dims, tree)


def _scale_muon_to_adam_rms() -> optax.GradientTransformation:
    """Muon's orthogonalised update O (unit singular values: RMS 1/sqrt(max(fan_in,
    fan_out))) times MUON_CONSISTENT_RMS * sqrt(max(fan_in, fan_out)), so its RMS is AdamW's
    typical 0.2 and the recipe's groups share one learning rate (Moonlight's rule).
    fan_in, fan_out: the products of the matrix's input and output axes. (optax keeps this
    step in a private module, `optax.contrib._muon.scale_by_shape`: restated here.)"""

    def update_fn(updates, state, params=None):
        def scale(path, u):
            role = _role_at(path, u)[1]
            fan_in = math.prod(u.shape[a] for a in role.in_axes)
            fan_out = math.prod(u.shape[a] for a in role.out_axes)
            return u * (MUON_CONSISTENT_RMS * math.sqrt(max(fan_in, fan_out)))

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _group_rule(cfg: OptimConfig, name: str, group: ParamGroup | None) -> tuple[str, float, float]:
    """(rule, LR scale, weight decay) of group `name` (module doc)."""
    wd = cfg.weight_decay if group is None or group.weight_decay is None else group.weight_decay
    if group is not None:
        return group.rule, group.lr_scale, wd
    if name == RECIPE_GROUPS["matrix"]:
        return "muon", 1.0, cfg.weight_decay
    if name in (RECIPE_GROUPS["embedding"], RECIPE_GROUPS["head"], RECIPE_GROUPS["table"]):
        return "sinkhorn", 1.0, 0.0
    if name == RECIPE_GROUPS["vector"]:
        return "adamw", 1.0, 0.0
    return "adamw", 1.0, wd


def make_optimizer(cfg: OptimConfig, total_steps: int, params) -> optax.GradientTransformation:
    """The full update rule for `params` (used only for its tree structure and paths)."""
    labels = param_group_labels(params, cfg.param_groups, cfg.recipe)
    group_cfg = {g.name: g for g in cfg.param_groups}
    used = set(jax.tree.leaves(labels))

    def transform(name: str) -> optax.GradientTransformation:
        g = group_cfg.get(name)
        rule, scale, wd = _group_rule(cfg, name, g)
        momentum = g.momentum if g is not None else RECIPE_MOMENTUM
        if rule == "sinkhorn":  # balanced momentum, unit RMS, x gamma
            return optax.chain(
                sinkhorn_balanced_momentum(momentum, rows_last=name == RECIPE_GROUPS["head"]),
                optax.add_decayed_weights(wd),
                optax.scale_by_learning_rate(lr_schedule(cfg, total_steps, scale * SINKHORN_GAMMA)),
            )
        if rule == "muon":  # optax.contrib.muon's muon half (every leaf here is a matrix)
            return optax.chain(
                optax.contrib.scale_by_muon(
                    beta=momentum, nesterov=True, weight_dimension_numbers=_muon_dimensions
                ),
                _scale_muon_to_adam_rms(),
                optax.add_decayed_weights(wd),
                optax.scale_by_learning_rate(lr_schedule(cfg, total_steps, scale)),
            )
        return optax.adamw(
            lr_schedule(cfg, total_steps, scale),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=wd,
        )

    transforms = {name: transform(name) for name in sorted(used)}
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    chain.append(optax.multi_transform(transforms, labels))
    return optax.chain(*chain)


def optimizer_groups(cfg: OptimConfig, total_steps: int, params) -> list[dict]:
    """One row per group that has params: {"group", "rule", "peak_lr", "scaling",
    "weight_decay", "leaves", "params"}; `scaling` says how the peak LR follows from
    optim.lr (what a run prints at its start)."""
    labels = traverse_util.flatten_dict(param_group_labels(params, cfg.param_groups, cfg.recipe))
    flat = traverse_util.flatten_dict(params)
    group_cfg = {g.name: g for g in cfg.param_groups}
    rows = []
    for name in sorted(set(labels.values())):
        rule, scale, wd = _group_rule(cfg, name, group_cfg.get(name))
        leaves = [flat[p] for p, n in labels.items() if n == name]
        factor = scale * (SINKHORN_GAMMA if rule == "sinkhorn" else 1.0)
        scaling = f"lr x {scale:g}" if scale != 1.0 else "lr"
        if rule == "sinkhorn":
            scaling += f" x gamma {SINKHORN_GAMMA:g} (unit-RMS balanced update)"
        elif rule == "muon":
            scaling += f" (update x {MUON_CONSISTENT_RMS:g} sqrt(max(fan_in, fan_out)): AdamW RMS)"
        rows.append(
            {
                "group": name,
                "rule": rule,
                "peak_lr": cfg.lr * factor,
                "scaling": scaling,
                "weight_decay": wd,
                "leaves": len(leaves),
                "params": sum(int(math.prod(x.shape)) for x in leaves),
            }
        )
    return rows


def module_norms(prefix: str, tree: dict) -> dict:
    """{"<prefix>/<module>": global L2 norm} per top-level entry of a params-shaped tree
    (embed, block_<i> / layers_<a>_<b> runs, final_norm, head)."""
    return {f"{prefix}/{name}": optax.tree.norm(sub) for name, sub in tree.items()}
