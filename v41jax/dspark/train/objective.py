"""The drafter's training objective on a frozen target (DSpark, DeepSeek-V4.1 report).

A packed batch of sequences x [B, T] goes once through the frozen target, giving its features
f_t (the configured layers' outputs, concatenated: F = len(layers) * D) and its next-token
logits at every position. Anchors a are drawn at random positions; anchor a's block predicts
x_{a+1} .. x_{a+K} from the context f_s, a - window <= s < a (same document), and the anchor
token x_a. Draft k (k = 1..K) is scored against p_k = softmax(target logits at a + k - 1),
the distribution the target itself samples x_{a+k} from, with the Markov term on the true
previous token (teacher forcing):

    loss = sum_{n,k} w_k [ CE(p_k, q_k) + tv_weight TV(q_k, p_k)
                           + conf_weight BCE(sigmoid(c_k), 1 - TV(q_k, p_k)) ] / sum w_k
    w_k = decay^(k-1) * [position a+k-1 is in the anchor's document and a+k-1 < T]

1 - TV(q, p) = sum_v min(p, q) is the probability the exact verifier accepts a draft from q
(Leviathan et al. 2023), so the confidence head learns the per-position acceptance probability and
the soft cross-entropy pulls q towards the distribution the verifier compares it with.
With `targets="tokens"`, p_k is the one-hot of the corpus token (plain next-token training).
c_k is the confidence head's logit (`drafter.confidence_logits`): for
`confidence_input="prev_token"` it reads the true previous token x_{a+k-1} (x_a the anchor),
as the Markov term does; the target 1 - TV(q_k, p_k) is the same for both heads.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import Drafter, FrozenTarget, confidence_logits, previous_tokens
from v41jax.dspark.model.markov import teacher_forced_logits
from v41jax.dspark.train.config import DrafterTrainConfig
from v41jax.model.transformer import Transformer


def target_features(
    target_params: Any, target_cfg: ModelConfig, layer_ids: tuple[int, ...], batch: dict
) -> tuple[jax.Array, jax.Array]:
    """Frozen target pass over a packed batch: (features [B, T, F], logits float32 [B, T, V]).

    Features are the outputs of `layer_ids` concatenated on the last axis. Both carry no
    gradient (stop_gradient): the backbone is not trained by the drafter's loss.
    """
    extras = {k: v for k, v in batch.items() if k.startswith("engram_ids_")}
    out = Transformer(target_cfg).apply(
        {"params": target_params},
        batch["inputs"],
        batch["positions"],
        batch["segment_ids"],
        hidden_layers=tuple(layer_ids),
        extras=extras,
    )
    feats = jnp.concatenate([out.hidden[i] for i in layer_ids], axis=-1)
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.logits.astype(jnp.float32))


def sample_anchors(rng: np.random.Generator, batch_size: int, seq_len: int, n: int) -> np.ndarray:
    """Anchor positions int32 [B, N], uniform on [0, T-2] (each has at least one target)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 to hold an anchor and its next token")
    return rng.integers(0, seq_len - 1, size=(batch_size, n)).astype(np.int32)


def block_targets(batch: dict, target_logits, anchors_BxN, k: int):
    """Per anchor and draft position: (anchor tokens [B, N], true next tokens [B, N, K],
    target logits [B, N, K, V] at a + k - 1, valid mask float32 [B, N, K])."""
    b, t = batch["inputs"].shape
    idx_BxNxK = anchors_BxN[..., None] + jnp.arange(k)  # position predicting draft k + 1
    inside = idx_BxNxK < t
    idx = jnp.minimum(idx_BxNxK, t - 1)
    take = jax.vmap(lambda row, i: row[i])  # per batch row: [T, ...] x [N, K] -> [N, K, ...]
    seg = batch["segment_ids"]
    same_doc = take(seg, idx) == take(seg, anchors_BxN)[..., None]
    anchors = take(batch["inputs"], anchors_BxN)
    next_tokens = take(batch["targets"], idx)
    logits = take(target_logits, idx)
    return anchors, next_tokens, logits, (inside & same_doc).astype(jnp.float32)


def drafter_loss(
    drafter_params: Any,
    frozen: FrozenTarget,
    feats_BxTxF: jax.Array,
    target_logits_BxTxV: jax.Array,
    batch: dict,
    anchors_BxN: jax.Array,
    *,
    drafter: DrafterConfig,
    target_cfg: ModelConfig,
    train: DrafterTrainConfig,
) -> tuple[jax.Array, dict]:
    """The loss of the module docstring and per-position metrics (`accept_k`: mean 1 - TV)."""
    k = drafter.block_size
    b, t = batch["inputs"].shape
    anchors, next_tokens, p_logits, valid = block_targets(
        batch, target_logits_BxTxV, anchors_BxN, k
    )
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    take = jax.vmap(lambda row, i: row[i])
    out = Drafter(drafter, target_cfg).apply(
        {"params": drafter_params},
        frozen,
        feats_BxTxF,
        slots,
        jnp.ones((b, t), bool),
        anchors,
        anchors_BxN,
        batch["segment_ids"],
        take(batch["segment_ids"], anchors_BxN),
    )
    markov = drafter_params.get("markov") if drafter.uses_markov else None
    hidden = out.hidden if drafter.markov_context else None
    q_logits = teacher_forced_logits(out.base_logits, markov, anchors, next_tokens, hidden)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    q = jnp.exp(log_q)
    p = jax.nn.softmax(p_logits, axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)  # [B, N, K]
    if train.targets == "tokens":
        ce = -jnp.take_along_axis(log_q, next_tokens[..., None], axis=-1)[..., 0]
    else:
        ce = -jnp.sum(p * log_q, axis=-1)
    accept = jax.lax.stop_gradient(1.0 - tv)
    # "prev_token": c_k reads the true previous token (teacher forcing, as the Markov term)
    conf = confidence_logits(drafter_params, drafter, out, previous_tokens(anchors, next_tokens))
    # BCE with a soft label y: -(y log s(c) + (1 - y) log(1 - s(c))), in the stable log-sigmoid form
    bce = -(accept * jax.nn.log_sigmoid(conf) + (1.0 - accept) * jax.nn.log_sigmoid(-conf))
    w = valid * train.decay ** jnp.arange(k, dtype=jnp.float32)
    per = ce + train.tv_weight * tv + train.conf_weight * bce
    loss = jnp.sum(w * per) / jnp.maximum(jnp.sum(w), 1.0)
    count_K = jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1.0)
    metrics = {
        "loss": loss,
        "ce": jnp.sum(valid * ce) / jnp.maximum(valid.sum(), 1.0),
        "conf_bce": jnp.sum(valid * bce) / jnp.maximum(valid.sum(), 1.0),
        "accept": jnp.sum(valid * accept, axis=(0, 1)) / count_K,  # [K]
        "conf": jnp.sum(valid * jax.nn.sigmoid(conf), axis=(0, 1)) / count_K,  # [K]
    }
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("drafter", "target_cfg", "train", "layer_ids"))
def eval_metrics(
    drafter_params, target_params, frozen, batch, anchors, *, drafter, target_cfg, train, layer_ids
):
    """`drafter_loss`'s metrics on one batch (no gradient): for evaluation."""
    feats, logits = target_features(target_params, target_cfg, layer_ids, batch)
    _, metrics = drafter_loss(
        drafter_params,
        frozen,
        feats,
        logits,
        batch,
        anchors,
        drafter=drafter,
        target_cfg=target_cfg,
        train=train,
    )
    return metrics
