"""The drafter's train state {params, opt_state}, built with the training stack's pieces.

Optimizer and schedule: `v41jax.train.optimizer.make_optimizer` on the drafter's settings
(`train.optim`, `v41jax.dspark.train.config.drafter_optim`): AdamW (b1 0.9, b2 0.95), linear
warmup then a cosine to 0.1 x lr over train.steps, global-norm clipping, one parameter
group. State creation: as `v41jax.train.state.make_state_fns` does it, the shardings come in
one step from the parameters' logical annotations (`sharding.tree_shardings` on the abstract
boxed state, Adam's moments included), on the mesh the frozen target runs on; the state is
created in that layout, and a checkpoint restores straight into it. `abstract_drafter_params`
gives the params alone in the same shardings, for decoding (no optimizer is built).

Drafter checkpoints written before this used `chain(clip, adamw)` without the one-group
`multi_transform`: `restore_drafter_state` reads them in that structure and rewraps the same
leaves (step count, first and second moments) into today's, so they resume exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from v41jax import sharding
from v41jax.dspark.model.drafter import Drafter
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.optimizer import make_optimizer


def drafter_optimizer(cfg: DrafterRunConfig, params) -> optax.GradientTransformation:
    """`make_optimizer` for a drafter with `params`' tree (plain or boxed)."""
    return make_optimizer(cfg.train.optim, cfg.train.loop.steps, params)


def drafter_variables(cfg: DrafterRunConfig, target_cfg, frozen, key) -> dict:
    """`Drafter.init` on dummy inputs of the right widths: boxed variables."""
    layer_ids = cfg.drafter.layer_ids_for(target_cfg.num_layers)
    f = len(layer_ids) * target_cfg.d_model
    return Drafter(cfg.drafter, target_cfg).init(
        key,
        frozen,
        jnp.zeros((1, 2, f), jnp.float32),
        jnp.arange(2, dtype=jnp.int32)[None],
        jnp.ones((1, 2), bool),
        jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1, 1), jnp.int32),
    )


def _placed(boxed_abstract, mesh):
    """(shardings from the logical annotations of a boxed abstract tree, the unboxed tree
    as ShapeDtypeStructs carrying them)."""
    shardings = sharding.tree_shardings(mesh, boxed_abstract)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.unbox(boxed_abstract),
        shardings,
    )
    return shardings, abstract


def _boxed_params(cfg: DrafterRunConfig, target_cfg, frozen):
    key = jax.random.key(0)
    return jax.eval_shape(lambda: drafter_variables(cfg, target_cfg, frozen, key)["params"])


def abstract_drafter_params(cfg: DrafterRunConfig, target_cfg, frozen, mesh):
    """The drafter's params as ShapeDtypeStructs in their shardings on `mesh` (those of
    `drafter_state_fns`' state), for a params-only restore: no optimizer is built."""
    return _placed(_boxed_params(cfg, target_cfg, frozen), mesh)[1]


def drafter_state_fns(cfg: DrafterRunConfig, target_cfg, frozen, mesh):
    """(optimizer, new_state(params) -> state, state_shardings, abstract_state).

    new_state places `params` (a plain tree) and a fresh optimizer state in the shardings
    on `mesh`; abstract_state holds ShapeDtypeStructs carrying them (for restore)."""
    boxed = _boxed_params(cfg, target_cfg, frozen)
    optimizer = drafter_optimizer(cfg, nn.unbox(boxed))
    # from the BOXED params, so Adam's moments carry their parameter's logical axes
    abstract_boxed = jax.eval_shape(lambda: {"params": boxed, "opt_state": optimizer.init(boxed)})
    shardings, abstract = _placed(abstract_boxed, mesh)
    new_state = jax.jit(
        lambda params: {"params": params, "opt_state": optimizer.init(params)},
        out_shardings=shardings,
    )
    return optimizer, new_state, shardings, abstract


def _has_key(tree: Any, name: str) -> bool:
    if isinstance(tree, dict):
        return name in tree or any(_has_key(v, name) for v in tree.values())
    if isinstance(tree, list | tuple):
        return any(_has_key(v, name) for v in tree)
    return False


def _legacy_opt_structure(cfg: DrafterRunConfig, params_abstract):
    """The tree structure of the optimizer state drafter checkpoints had before
    `drafter_optimizer`: chain(clip (if on), adamw), no multi_transform."""
    t = cfg.train.optim
    chain = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    lr = optax.constant_schedule(0.0)  # a schedule, as it was: its count is in the state
    chain.append(optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=t.weight_decay))
    return jax.tree.structure(jax.eval_shape(optax.chain(*chain).init, params_abstract))


def restore_drafter_state(
    ckpt: Checkpointer, step: int, abstract: dict, cfg: DrafterRunConfig
) -> tuple[dict, dict]:
    """(state, data-iterator state) of checkpoint `step`, in `abstract`'s shardings; a
    checkpoint of the earlier optimizer structure is read as such and rewrapped."""
    saved = ckpt.saved_tree(step)
    if not isinstance(saved, dict) or _has_key(saved.get("opt_state"), "inner_states"):
        return ckpt.restore(step, abstract)
    new = abstract["opt_state"]
    leaves = jax.tree.leaves(new)
    legacy = _legacy_opt_structure(cfg, abstract["params"])
    if legacy.num_leaves != len(leaves):
        raise ValueError(
            f"checkpoint {step} in {ckpt.directory}: its optimizer state is neither today's "
            f"structure nor the earlier chain(clip, adamw) one ({legacy.num_leaves} leaves "
            f"expected, the drafter's optimizer has {len(leaves)})"
        )
    # the same leaves in the same order: count, mu (params' order), nu
    read_as = {"params": abstract["params"], "opt_state": jax.tree.unflatten(legacy, leaves)}
    state, data = ckpt.restore(step, read_as)
    opt_state = jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(state["opt_state"]))
    return {"params": state["params"], "opt_state": opt_state}, data
