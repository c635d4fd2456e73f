"""The LM head: the final norm and the output projection, over all positions or in chunks.

    h      = final_norm(read-out of the residual stream)            [B, T, D]
    logits = h E^T   (tied to the embedding E [V, D])   or   h W_head   (W_head [D, V])
                                                        float32 [B, T, V]

With targets y and `cfg.logits_chunk = c > 0` the head never forms [B, T, V]: it returns per
position lse = log sum_v exp(logits) and the target's logit z_y (`chunked_head_stats`,
c positions at a time), from which the training loss is lse - z_y.

Param names are the model's checkpoint layout: "final_norm" ({"scale"} of an `RMSNorm`, or of
a `NormScale` when the residual stream folds the norm into its read-out, mHC single-pass) and
the untied "head" [D, V] sit at the top of the model's params, beside "embed": the
`Transformer` shares its scope with the `Head` (`flax.linen.share_scope`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.mhc.layer import NormScale
from v41jax.model.layers import RMSNorm, normal_init

LOGITS_AXES = ("batch", "length", "act_vocab")


class HeadOutput(NamedTuple):
    """`logits` float32 [B, T, V], or None when chunked; then `lse` and `target_logit` are
    float32 [B, T] (logsumexp of each position's logits, the target's logit)."""

    logits: jax.Array | None
    lse: jax.Array | None = None
    target_logit: jax.Array | None = None


class Head(nn.Module):
    """Final norm + output projection (module docstring).

    `final_norm` is a submodule the residual stream's `read_out` applies (`RMSNorm`, or its
    `NormScale` with `folded_norm`); `__call__` projects the normalised hidden state.
    """

    cfg: ModelConfig
    folded_norm: bool = False  # the stream's read-out normalises; only the scale lives here

    def setup(self):
        c = self.cfg
        param_dtype = jnp.dtype(c.param_dtype)
        if self.folded_norm:
            self.final_norm = NormScale(c.d_model, param_dtype)
        else:
            self.final_norm = RMSNorm(eps=c.norm_eps, param_dtype=param_dtype)
        if not c.tie_embeddings:
            self.w_head = self.param(
                "head",
                normal_init(c.init_std, ("embed", "vocab")),
                (c.d_model, c.vocab_size),
                param_dtype,
            )

    def __call__(
        self,
        h_BxTxD: jax.Array,
        embedding_VxD: jax.Array | None = None,
        targets_BxT: jax.Array | None = None,
    ) -> HeadOutput:
        """Logits of the normalised hidden state h [B, T, D]; tied: `embedding_VxD` is the
        embedding table E [V, D] (`cfg.tie_embeddings`), else the "head" param [D, V] is used.
        With `targets_BxT` and `cfg.logits_chunk > 0` (and not initialising): (None, lse,
        target_logit) instead."""
        c = self.cfg
        dtype = jnp.dtype(c.compute_dtype)
        if c.tie_embeddings:
            if embedding_VxD is None:
                raise ValueError("Head: a tied head needs the embedding table")
            w_head, spec = embedding_VxD, "btd,vd->btv"
        else:
            w_head, spec = self.w_head, "btd,dv->btv"

        def logits_of(x):  # accumulated in float32
            logits = jnp.einsum(
                spec, x.astype(dtype), w_head.astype(dtype), preferred_element_type=jnp.float32
            )
            return nn.with_logical_constraint(logits, LOGITS_AXES)

        if targets_BxT is not None and c.logits_chunk and not self.is_initializing():
            lse, target = chunked_head_stats(logits_of, h_BxTxD, targets_BxT, c.logits_chunk)
            return HeadOutput(None, lse, target)
        return HeadOutput(logits_of(h_BxTxD))


def chunked_head_stats(head, x_BxTxD: jax.Array, targets_BxT: jax.Array, chunk: int):
    """(lse, target logit), float32 [B, T], of `head(x)` [B, T, V] computed `chunk`
    positions at a time, each chunk under `jax.checkpoint`: the forward keeps [B, chunk, V]
    logits at once and the backward recomputes each chunk's, so no [B, T, V] array exists.

        lse[b, t] = log sum_v exp(z[b, t, v]),    target[b, t] = z[b, t, y[b, t]]
    """
    b, t, d = x_BxTxD.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    x = jnp.pad(x_BxTxD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d)
    y = jnp.pad(targets_BxT, ((0, 0), (0, pad))).reshape(b, n, chunk)

    @jax.checkpoint
    def one(x_BxCxD, y_BxC):
        logits = head(x_BxCxD)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse, jnp.take_along_axis(logits, y_BxC[..., None], axis=-1)[..., 0]

    lse, target = jax.lax.map(lambda xy: one(*xy), (x.swapaxes(0, 1), y.swapaxes(0, 1)))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]  # noqa: E731
    return unchunk(lse), unchunk(target)
