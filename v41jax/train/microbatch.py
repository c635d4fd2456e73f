"""Gradient accumulation (`train.microbatches = k`): one optimizer step over k microbatches.

The batch [B, ...] is split into k microbatches of B/k rows, microbatch i holding rows
i, i + k, i + 2k, ...: with the batch sharded in contiguous blocks over the devices, every
device then holds B/(k D) rows of each microbatch and no row moves. A `lax.scan` runs the
forward and backward of one microbatch at a time (activations of B/k rows live at once) and
sums the gradients of

    L_i = loss_i * n_i / N,      n_i = the microbatch's loss tokens, N = the batch's,

whose sum over i is the full batch's token-mean loss (cross-entropy and z-loss are token
sums divided by N), so the summed gradient equals the full batch's up to float32 summation
order. Metrics: loss, ce and log_z_sq are token-weighted means, tokens a sum, the mHC gains
the max, other metrics (MoE) the mean over microbatches. MoE's load-balancing loss is a
statistic of the whole batch; accumulation uses the token-weighted mean of the
microbatches' (as large-batch MoE training does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_WEIGHTED = ("loss", "ce", "log_z_sq")


def split_microbatches(batch: dict, k: int) -> dict:
    """{key: [k, B/k, ...]}: microbatch i = rows i, i + k, ... of every entry."""
    out = {}
    for key, x in batch.items():
        if x.shape[0] % k:
            raise ValueError(f"batch entry {key!r}: {x.shape[0]} rows do not split into {k}")
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        out[key] = jnp.moveaxis(x, 1, 0)
    return out


def accumulated_grads(loss_fn, params, batch: dict, k: int):
    """(metrics, grads) of the full batch from k microbatches; `loss_fn(params, batch)` ->
    (token-mean loss, metrics with "tokens")."""
    micro = split_microbatches(batch, k)
    total = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)

    def weighted(p, mb):
        loss, metrics = loss_fn(p, mb)
        return loss * metrics["tokens"] / total, metrics

    grad_fn = jax.value_and_grad(weighted, has_aux=True)

    def body(acc, mb):
        (_, metrics), grads = grad_fn(params, mb)
        return jax.tree.map(jnp.add, acc, grads), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, per_micro = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    share = per_micro["tokens"] / total  # [k]
    metrics = {}
    for key, values in per_micro.items():
        if key in _WEIGHTED:
            metrics[key] = jnp.sum(values * share)
        elif key == "tokens":
            metrics[key] = jnp.sum(values)
        elif key.startswith("mhc_"):
            metrics[key] = jnp.max(values)
        else:
            metrics[key] = jnp.mean(values)
    return metrics, grads
