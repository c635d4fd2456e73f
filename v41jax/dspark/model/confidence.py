"""The drafter's confidence c_k for either head (`DrafterConfig.confidence_input`; the
equations: `v41jax.dspark.model.drafter`'s module docstring and docs/dspark.md section 3).

    "hidden":     c_k = hidden_k w_c + b_c
    "prev_token": c_k = hidden_k w_c + b_c + u(x_{k-1}) . w_p     (the DSpark paper,
                  arXiv 2607.05147: w . [hidden_k ; W1[x_{k-1}]] with W1 the Markov table u)

x_0 is the anchor, x_{k-1} (k >= 2) the sampled draft k-1 in decoding and the true previous
token in training (teacher forcing, as `markov.teacher_forced_logits`). Both are exported by
`v41jax.dspark.model.drafter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.markov import check_token_range

if TYPE_CHECKING:  # drafter.py imports this module
    from v41jax.dspark.model.drafter import DrafterOutput


def previous_tokens(anchors_BxN: jax.Array, drafts_BxNxK: jax.Array) -> jax.Array:
    """x_{k-1} for k = 1..K, int32 [B, N, K]: [anchor, d_1 .. d_{K-1}] (d_K is not read)."""
    prev = jnp.concatenate([anchors_BxN[..., None], drafts_BxNxK[..., :-1]], axis=-1)
    return prev.astype(jnp.int32)


def confidence_logits(
    drafter_params: Any, cfg: DrafterConfig, out: DrafterOutput, prev_tokens_BxNxK: jax.Array
) -> jax.Array:
    """The confidence logits c_k of the module docstring, float32 [B, N, K].

    "hidden": `out.confidence_logits` (prev_tokens unread). "prev_token": `out.confidence_logits
    + u(x_{k-1}) . w_p` with x_{k-1} = prev_tokens[..., k-1] (`previous_tokens`: [..., 0] the
    anchor x_0, [..., k] the draft x_k). u is read under stop_gradient: the Markov table is
    trained by the drafter's cross-entropy only, as for a "hidden" drafter, so the confidence
    loss cannot trade acceptance for calibration. float32 at HIGHEST precision (as markov_bias).
    """
    hidden_part = out.confidence_logits.astype(jnp.float32)
    if cfg.confidence_input == "hidden":
        return hidden_part
    if prev_tokens_BxNxK.shape != hidden_part.shape:
        raise ValueError(
            f"prev_tokens has shape {tuple(prev_tokens_BxNxK.shape)}; expected "
            f"{tuple(hidden_part.shape)} (the confidence logits')"
        )
    params = nn.unbox(drafter_params)
    u = jax.lax.stop_gradient(params["markov"]["u"]).astype(jnp.float32)
    check_token_range("prev_tokens", prev_tokens_BxNxK, u.shape[0])
    u_prev = jnp.take(u, prev_tokens_BxNxK.astype(jnp.int32), axis=0)  # [B, N, K, r]
    w_p = params["confidence_prev"].astype(jnp.float32)
    term = jnp.einsum("bnkr,r->bnk", u_prev, w_p, precision=jax.lax.Precision.HIGHEST)
    return hidden_part + term


def draft_confidence(
    drafter_params: Any, cfg: DrafterConfig, out: DrafterOutput, prev_tokens_BxNxK: jax.Array
) -> jax.Array:
    """sigmoid(c_k), float32 [B, N, K]: P(draft k accepted | drafts < k accepted).

    "hidden": bitwise `jax.nn.sigmoid(out.confidence_logits)`, prev_tokens ignored (may be
    anything of shape [B, N, K]). "prev_token": from `out` (hidden part) and u[prev_tokens]
    (`confidence_logits`), prev_tokens[..., 0] the anchor, [..., k] the draft x_k."""
    if cfg.confidence_input == "hidden":
        return jax.nn.sigmoid(out.confidence_logits)
    return jax.nn.sigmoid(confidence_logits(drafter_params, cfg, out, prev_tokens_BxNxK))
