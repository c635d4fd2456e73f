"""The drafter's step pieces: its initial params, its jitted update on a frozen-target pass,
the anchors of a step, and its evaluation on fixed validation batches.

Only the drafter's parameters are in the optimizer; the target's params enter the step as
arguments under stop_gradient, so the backbone is bit-identical after training (tested).
The anchors at step s are a pure function of (seed, s), as is the batch, so resume is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from v41jax import sharding
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.dspark.train.objective import drafter_loss, eval_metrics, sample_anchors
from v41jax.dspark.train.state import drafter_variables


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
