"""Loss, the jitted train step and the eval step, with explicit shardings.

Loss per token t (logits z, target y, mask m):
    ce_t = logsumexp(z_t) - z_t[y_t]
    loss = sum_t m_t ce_t / sum_t m_t  +  z_coef * sum_t m_t logsumexp(z_t)^2 / sum_t m_t
The z-loss term (PaLM) keeps the softmax normaliser near 1 so bf16 logits stay in range.
The model's features add their auxiliary loss (`ModelOutput.aux_loss`, e.g. MoE's weighted
load-balancing loss) and hand their metrics up in `ModelOutput.metrics` (e.g. MoE routing
statistics, mHC composite gains): the step adds the one and logs the other, without knowing
which features produced them. Batch entries other than the base keys (`BASE_BATCH_KEYS`)
go to the model as its per-token `extras` (e.g. Engram hash ids or pre-gathered rows).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from v41jax import sharding
from v41jax.config import Config
from v41jax.engram.training import table_strategy
from v41jax.model import ENGRAM_ROWS_PREFIX
from v41jax.model.metric import Metric, metric_values
from v41jax.train.batches import BASE_BATCH_KEYS, batch_keys
from v41jax.train.microbatch import accumulated_grads
from v41jax.train.optimizer import lr_schedule, module_norms, schedule_length
from v41jax.train.state import TrainState


def next_token_loss(
    logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array, z_loss: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean cross-entropy (+ optional z-loss), all in fp32. Returns (loss, metrics)."""
    logits = logits_BxTxV.astype(jnp.float32)
    lse_BxT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    return loss_from_stats(lse_BxT, target_logit_BxT, mask_BxT, z_loss)


def loss_from_stats(
    lse_BxT: jax.Array, target_logit_BxT: jax.Array, mask_BxT: jax.Array, z_loss: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`next_token_loss` from each position's logsumexp and target logit (float32 [B, T]),
    e.g. the model's chunked head (`model.logits_chunk`)."""
    mask = mask_BxT.astype(jnp.float32)
    ce_BxT = lse_BxT - target_logit_BxT
    denom = jnp.maximum(mask.sum(), 1.0)
    ce = (ce_BxT * mask).sum() / denom
    zl = (jnp.square(lse_BxT) * mask).sum() / denom
    loss = ce + z_loss * zl
    return loss, {"loss": loss, "ce": ce, "log_z_sq": zl, "tokens": mask.sum()}


def _forward_loss(model, params, batch, z_loss):
    """(loss, metrics) of one batch: the token loss plus the model's `aux_loss`; metrics
    those of `loss_from_stats` (loss then the total) and the model's `metrics`, all as
    `Metric`s (the loss terms token means, tokens a sum) for gradient accumulation."""
    extras = {k: v for k, v in batch.items() if k not in BASE_BATCH_KEYS}
    out = model.apply(
        {"params": params},
        batch["inputs"],
        batch["positions"],
        batch["segment_ids"],
        extras=extras,
        targets_BxT=batch["targets"],
    )
    if out.logits is None:  # the chunked head (model.logits_chunk): no [B, T, V] logits
        loss, metrics = loss_from_stats(out.lse, out.target_logit, batch["loss_mask"], z_loss)
    else:
        loss, metrics = next_token_loss(out.logits, batch["targets"], batch["loss_mask"], z_loss)
    loss = loss + out.aux_loss
    metrics = {k: Metric(v, "sum" if k == "tokens" else "token_mean") for k, v in metrics.items()}
    return loss, dict(metrics, loss=Metric(loss, "token_mean"), **out.metrics)


def make_train_step(
    cfg: Config, mesh: Mesh, model, optimizer, state_shardings: TrainState
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """jit(train_step) with state and batch shardings; the input state is donated. The
    function returned runs it, then the table strategy's `finish_step` on its outputs."""
    schedule = lr_schedule(cfg.optim, schedule_length(cfg))
    z_loss = cfg.optim.z_loss

    k = cfg.train.microbatches

    def dense_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        def loss_fn(params, batch=batch):
            return _forward_loss(model, params, batch, z_loss)

        if k > 1:  # gradient accumulation over k sequential microbatches
            metrics, grads = accumulated_grads(loss_fn, state.params, batch, k)
        else:
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            metrics = metric_values(metrics)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
        metrics |= module_norms("grad_norm", grads) | module_norms("update_norm", updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    def forward(params, batch):  # a table placement's own step: one microbatch, plain values
        loss, metrics = _forward_loss(model, params, batch, z_loss)
        return loss, metric_values(metrics)

    # the Engram tables' placement may bring its own step (`v41jax.engram.training`)
    tables, replicated = table_strategy(cfg), sharding.replicated(mesh)
    train_step = tables.train_step(dense_step, forward, optimizer, schedule, module_norms)
    out_shardings = tables.step_out_shardings((state_shardings, replicated), replicated)

    jitted = jax.jit(
        train_step,
        in_shardings=(state_shardings, _batch_shardings(cfg, mesh)),
        out_shardings=out_shardings,
        donate_argnums=(0,),
    )
    return _with_mesh(mesh, jitted, finish=tables.finish_step)


def make_eval_step(cfg: Config, mesh: Mesh, model, param_shardings) -> Callable:
    """jit(eval_step)(params, batch) -> {"loss_sum", "tokens"} (sums, so batches add up)."""

    def eval_step(params, batch):
        metrics = metric_values(_forward_loss(model, params, batch, 0.0)[1])
        return {"loss_sum": metrics["ce"] * metrics["tokens"], "tokens": metrics["tokens"]}

    jitted = jax.jit(
        eval_step,
        in_shardings=(param_shardings, _batch_shardings(cfg, mesh)),
        out_shardings=sharding.replicated(mesh),
    )
    return _with_mesh(mesh, jitted)


def _batch_shardings(cfg: Config, mesh: Mesh) -> dict:
    """Batch entries split over (data, fsdp), plus the entries the Engram tables' placement
    adds (`TableStrategy.batch_shardings`: e.g. replicated gathered rows)."""
    out = {k: sharding.batch_sharding(mesh) for k in batch_keys(cfg.model)}
    return table_strategy(cfg).batch_shardings(out, sharding.replicated(mesh))


def _with_mesh(mesh: Mesh, fn: Callable, finish: Callable | None = None) -> Callable:
    """Trace and run `fn` with the mesh and logical-axis rules active, so the modules'
    `nn.with_logical_constraint` calls become real sharding constraints; `finish` (the table
    strategy's `finish_step`) takes its outputs. `.jitted` is `fn` itself (to lower)."""

    def wrapped(*args):
        with jax.set_mesh(mesh), sharding.axis_rules():
            out = fn(*args)
            return out if finish is None else finish(out)

    wrapped.jitted = fn
    return wrapped


def device_batch(mesh: Mesh, local_batch: dict) -> dict:
    """Per-process numpy batch -> global jax.Arrays sharded over (data, fsdp)."""
    batch_sharding, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    return {
        k: jax.make_array_from_process_local_data(
            replicated if k.startswith(ENGRAM_ROWS_PREFIX) else batch_sharding, v
        )
        for k, v in local_batch.items()
    }
