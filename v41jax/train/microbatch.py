"""Gradient accumulation (`train.microbatches = k`): one optimizer step over k microbatches.

The batch [B, ...] is split into k microbatches of B/k rows, microbatch i holding rows
i, i + k, i + 2k, ...: with the batch sharded in contiguous blocks over the devices, every
device then holds B/(k D) rows of each microbatch and no row moves. A `lax.scan` runs the
forward and backward of one microbatch at a time (activations of B/k rows live at once) and
sums the gradients of

    L_i = loss_i * n_i / N,      n_i = the microbatch's loss tokens, N = the batch's,

whose sum over i is the full batch's token-mean loss (cross-entropy and z-loss are token
sums divided by N), so the summed gradient equals the full batch's up to float32 summation
order. Metrics are `Metric`s, each combined over the microbatches by its own rule
(`v41jax.model.metric`): the loss terms are token-weighted means and tokens a sum (the
step's), the model's features say theirs (MoE statistics: means; mHC gains: the max).
MoE's load-balancing loss is a statistic of the whole batch; accumulation uses the mean of
the microbatches' (as large-batch MoE training does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41jax.model.metric import combine_metrics


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
    """(metrics {name: float32 []}, grads) of the full batch from k microbatches;
    `loss_fn(params, batch)` -> (token-mean loss, {name: Metric} with "tokens")."""
    micro = split_microbatches(batch, k)
    total = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)

    def weighted(p, mb):
        loss, metrics = loss_fn(p, mb)
        return loss * metrics["tokens"].value / total, metrics

    grad_fn = jax.value_and_grad(weighted, has_aux=True)

    def body(acc, mb):
        (_, metrics), grads = grad_fn(params, mb)
        return jax.tree.map(jnp.add, acc, grads), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, per_micro = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    share = per_micro["tokens"].value / total  # [k]
    return combine_metrics(per_micro, share), grads
