"""The DSpark drafter (DeepSeek-V4.1 report): one parallel forward drafts a block of K positions
from the frozen target's hidden states; a Markov head (`v41jax.dspark.model.markov`) then links
consecutive drafts, and a confidence head predicts per-position acceptance.

The drafter, its heads, the scheduler and the cost table: docs/dspark.md.

Shapes: B batch, S context slots, N draft blocks per row, K = block_size, D the target's
d_model, V its vocab, F = len(layer_ids) * D, G = H = drafter heads, Kd = D / H.

Context (the drafter's KV cache, written once when the target's features arrive):
    c_s = RMSNorm(feats_s W_proj)                      feats_s = concat_l h_l(s)  [F]
    k_s^l = rope(c_s Wk_l, pos_s),   v_s^l = c_s Wv_l  for every drafter layer l
Block n (anchor a_n at position p_n; input [E[a_n], m, ..., m], m a learned mask embedding,
RoPE positions p_n + i, i = 0..K-1), `num_layers` pre-norm blocks:
    x <- x + Attn(RMSNorm(x));   x <- x + SwiGLU(RMSNorm(x))
    keys/values = [context slots s with valid_s, p_n - window <= pos_s < p_n (same segment)]
                  + [the K positions of block n itself, bidirectional]; never other blocks
    hidden = RMSNorm(x);  base_logits = hidden W_head (float32);  c = hidden w_c + b_c
E and W_head are the target's, frozen (`FrozenTarget`, under stop_gradient); the drafter owns
no [V, D] table.

Confidence heads (`DrafterConfig.confidence_input`; `draft_confidence` gives sigmoid(c_k)):
    "hidden":     c_k = hidden_k w_c + b_c                       (`confidence_logits`)
    "prev_token": c_k = hidden_k w_c + b_c + u(x_{k-1}) . w_p    (the DSpark paper, arXiv
                  2607.05147: w . [hidden_k ; W1[x_{k-1}]], W1 = the Markov table u [V, r])
with x_0 the anchor and x_{k-1} the sampled draft k-1 (the true token in training). For
"prev_token", `DrafterOutput.confidence_logits` holds the hidden part hidden_k w_c + b_c only:
the previous-token term needs drafts sampled after this pass. A "hidden" confidence is fixed
before any draft is sampled, so any function of it may pick the verify length; a
"prev_token" one depends on x_{k-1}, so the length must be a stopping rule (verifying draft j
reads c_1..c_j only: the scheduler's admission="early_stop"), else the output is biased.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.dspark.model.confidence import confidence_logits, draft_confidence, previous_tokens
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.markov import check_token_range
from v41jax.kernels.attention import causal_attention
from v41jax.model.layers import RMSNorm, SwiGLU, apply_rope, normal_init

ContextKV = list[dict[str, jax.Array]]
# the confidence of either head, for the engine and the objective (v41jax.dspark.model.confidence)
__all__ = ["Drafter", "DrafterOutput", "FrozenTarget", "confidence_logits", "draft_confidence"]
__all__ += ["frozen_target", "previous_tokens"]


class FrozenTarget(NamedTuple):
    """The target's shared, frozen tables."""

    embedding: jax.Array  # [V, D] the target's token embedding
    head: jax.Array  # [D, V] the target's LM head (embedding.T when tied)


def frozen_target(target_params: Any, target_cfg: ModelConfig) -> FrozenTarget:
    """The target's embedding and LM head, unboxed and under `stop_gradient` so no gradient
    of a drafter loss reaches the backbone. Accepts the tree under "params" or its parent."""
    params = nn.unbox(target_params)
    if "embed" not in params and "params" in params:
        params = params["params"]
    embedding = params["embed"]["embedding"]
    head = embedding.T if target_cfg.tie_embeddings else params["head"]
    v, d = target_cfg.vocab_size, target_cfg.d_model
    if embedding.shape != (v, d) or head.shape != (d, v):
        raise ValueError(
            f"target embedding {tuple(embedding.shape)} / head {tuple(head.shape)} do not "
            f"match vocab_size={v}, d_model={d}"
        )
    return FrozenTarget(jax.lax.stop_gradient(embedding), jax.lax.stop_gradient(head))


class DrafterOutput(NamedTuple):
    base_logits: jax.Array  # float32 [B, N, K, V], before the Markov term
    hidden: jax.Array  # [B, N, K, D] final-normed hidden state per draft position
    # float32 [B, N, K]: hidden_k w_c + b_c. For "hidden" its sigmoid is P(draft k accepted |
    # prefix); for "prev_token" it lacks the previous-token term (`draft_confidence`).
    confidence_logits: jax.Array


def _shape_error(name: str, got: tuple, want: tuple) -> ValueError:
    return ValueError(f"{name} has shape {tuple(got)}; expected {tuple(want)}")


class _Attention(nn.Module):
    """Attention of a draft block over [context kv, its own block]. Params `q` [D, H, Kd],
    `k`, `v` [D, G, Kd], `o` [H, Kd, D] (as `v41jax.model.attention.Attention`)."""

    num_heads: int
    head_dim: int
    rope_theta: float
    init_std: float
    out_init_std: float
    dtype: Any
    param_dtype: Any

    def setup(self):
        d, h, k = self.num_heads * self.head_dim, self.num_heads, self.head_dim
        std, pd = self.init_std, self.param_dtype
        self.w_q = self.param("q", normal_init(std, ("embed", "heads", "head_dim")), (d, h, k), pd)
        self.w_k = self.param(
            "k", normal_init(std, ("embed", "kv_heads", "head_dim")), (d, h, k), pd
        )
        self.w_v = self.param(
            "v", normal_init(std, ("embed", "kv_heads", "head_dim")), (d, h, k), pd
        )
        self.w_o = self.param(
            "o", normal_init(self.out_init_std, ("heads", "head_dim", "embed")), (h, k, d), pd
        )

    def kv(self, x_BxTxD: jax.Array, positions_BxT: jax.Array) -> dict[str, jax.Array]:
        """Per-position keys/values: `k = rope(x Wk, pos)`, `v = x Wv`, each [B, T, G, Kd]."""
        x = x_BxTxD.astype(self.dtype)
        k_BxTxGxK = jnp.einsum("btd,dgk->btgk", x, self.w_k.astype(self.dtype))
        v_BxTxGxK = jnp.einsum("btd,dgk->btgk", x, self.w_v.astype(self.dtype))
        return {"k": apply_rope(k_BxTxGxK, positions_BxT, self.rope_theta), "v": v_BxTxGxK}

    def __call__(self, x_BxTxD, positions_BxT, ctx: dict[str, jax.Array], mask_BxTxSt):
        """`y = softmax(q [k_ctx; k_blk]^T / sqrt(Kd) + mask) [v_ctx; v_blk] Wo`, [B, T, D]."""
        x = x_BxTxD.astype(self.dtype)
        q_BxTxHxK = jnp.einsum("btd,dhk->bthk", x, self.w_q.astype(self.dtype))
        q_BxTxHxK = apply_rope(q_BxTxHxK, positions_BxT, self.rope_theta)
        own = self.kv(x, positions_BxT)
        k_all = jnp.concatenate([ctx["k"].astype(self.dtype), own["k"]], axis=1)
        v_all = jnp.concatenate([ctx["v"].astype(self.dtype), own["v"]], axis=1)
        out_BxTxHxK = causal_attention(q_BxTxHxK, k_all, v_all, mask_BxTxSt)
        return jnp.einsum("bthk,hkd->btd", out_BxTxHxK, self.w_o.astype(self.dtype))


class _Block(nn.Module):
    """Pre-norm block: `x <- x + Attn(RMSNorm(x)); x <- x + SwiGLU(RMSNorm(x))`."""

    cfg: DrafterConfig
    target: ModelConfig

    def setup(self):
        c, t = self.cfg, self.target
        dtype, pd = jnp.dtype(t.compute_dtype), jnp.dtype(t.param_dtype)
        # projections into the residual stream start smaller with depth (as in the target)
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.attn_norm = RMSNorm(eps=c.norm_eps, param_dtype=pd)
        self.attn = _Attention(
            c.num_heads, t.d_model // c.num_heads, t.rope_theta, c.init_std, out_std, dtype, pd
        )
        self.ffn_norm = RMSNorm(eps=c.norm_eps, param_dtype=pd)
        self.ffn = SwiGLU(c.d_ff or t.d_ff, c.init_std, out_std, dtype, pd)

    def context_kv(self, c_BxSxD, positions_BxS):
        return self.attn.kv(c_BxSxD, positions_BxS)

    def __call__(self, x_BxTxD, positions_BxT, ctx, mask_BxTxSt):
        x_BxTxD = x_BxTxD + self.attn(
            self.attn_norm(x_BxTxD), positions_BxT, ctx, mask_BxTxSt
        ).astype(x_BxTxD.dtype)
        return x_BxTxD + self.ffn(self.ffn_norm(x_BxTxD)).astype(x_BxTxD.dtype)


class _MarkovTables(nn.Module):
    """The Markov head's tables `u`, `w` [V, r], and for the contextual head (context > 0)
    `t` [V, H], `h` [D, H], `o` [H, r] with o = 0 at init (see `v41jax.dspark.model.markov`)."""

    vocab_size: int
    rank: int
    init_std: float
    param_dtype: Any
    context: int = 0
    d_model: int = 0

    def setup(self):
        v, r, h, pd = self.vocab_size, self.rank, self.context, self.param_dtype
        init = normal_init(self.init_std, ("vocab", None))
        self.u = self.param("u", init, (v, r), pd)
        self.w = self.param("w", init, (v, r), pd)
        if h:
            self.t = self.param("t", init, (v, h), pd)
            h_init = normal_init(self.init_std, ("embed", None))
            self.h = self.param("h", h_init, (self.d_model, h), pd)
            zeros = nn.with_logical_partitioning(nn.initializers.zeros, (None, None))
            self.o = self.param("o", zeros, (h, r), pd)

    def __call__(self) -> dict[str, jax.Array]:
        if self.context:
            return {"u": self.u, "w": self.w, "t": self.t, "h": self.h, "o": self.o}
        return {"u": self.u, "w": self.w}


class Drafter(nn.Module):
    """The DSpark drafter of `cfg` on top of a target of config `target` (module docstring).

    Params: `ctx_proj` [F, D], `ctx_norm/scale`, `mask_embedding` [D], `block_{l}/{attn_norm,
    attn/{q,k,v,o}, ffn_norm, ffn/{w_gate,w_up,w_down}}`, `final_norm/scale`,
    `confidence/{kernel [D, 1], bias [1]}`, and `markov/{u, w}` [V, r] when `cfg.uses_markov`
    (plus `markov/{t, h, o}` when `cfg.markov_context`, and `confidence_prev` [r] (w_p, zero at
    init: an untrained head is the "hidden" one) when `confidence_input == "prev_token"`).
    """

    cfg: DrafterConfig
    target: ModelConfig

    def setup(self):
        c, t = self.cfg, self.target
        if t.d_model % c.num_heads or (t.d_model // c.num_heads) % 2:
            raise ValueError(
                f"drafter.num_heads={c.num_heads} must divide d_model={t.d_model} into an even "
                "head dim (RoPE)"
            )
        pd = jnp.dtype(t.param_dtype)
        self.layer_ids = c.layer_ids_for(t.num_layers)
        d, f = t.d_model, len(self.layer_ids) * t.d_model
        self.ctx_proj = self.param("ctx_proj", normal_init(c.init_std, (None, "embed")), (f, d), pd)
        self.ctx_norm = RMSNorm(eps=c.norm_eps, param_dtype=pd)
        self.mask_embedding = self.param(
            "mask_embedding", normal_init(c.init_std, ("embed",)), (d,), pd
        )
        self.blocks = [_Block(c, t, name=f"block_{i}") for i in range(c.num_layers)]
        self.final_norm = RMSNorm(eps=c.norm_eps, param_dtype=pd)
        self.confidence = nn.Dense(
            1,
            dtype=jnp.float32,
            param_dtype=pd,
            kernel_init=normal_init(c.init_std, ("embed", None)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        )
        if c.confidence_input == "prev_token":
            zeros = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
            self.confidence_prev = self.param("confidence_prev", zeros, (c.markov_rank,), pd)
        if c.uses_markov:
            self.markov = _MarkovTables(
                t.vocab_size, c.markov_rank, c.init_std, pd, c.markov_context, t.d_model
            )

    def context_kv(self, feats_BxSxF: jax.Array, positions_BxS: jax.Array) -> ContextKV:
        """Per-layer context keys/values `[{"k", "v"}: [B, S, G, Kd]] * num_layers` from the
        target's concatenated features: `c = RMSNorm(feats W_proj)`, `k = rope(c Wk_l, pos)`,
        `v = c Wv_l`. Pure per position (slot s depends only on feats[s], positions[s]), so a
        decoding engine can cache it as the target's features arrive."""
        t = self.target
        f = len(self.layer_ids) * t.d_model
        if feats_BxSxF.ndim != 3 or feats_BxSxF.shape[-1] != f:
            raise ValueError(
                f"feats shape {tuple(feats_BxSxF.shape)}: last dim must be "
                f"len(layer_ids)={len(self.layer_ids)} * d_model={t.d_model} = {f} "
                f"(layer_ids={self.layer_ids})"
            )
        if positions_BxS.shape != feats_BxSxF.shape[:2]:
            raise _shape_error("ctx positions", positions_BxS.shape, feats_BxSxF.shape[:2])
        dtype = jnp.dtype(t.compute_dtype)
        c_BxSxD = jnp.einsum("bsf,fd->bsd", feats_BxSxF.astype(dtype), self.ctx_proj.astype(dtype))
        c_BxSxD = self.ctx_norm(c_BxSxD)
        return [block.context_kv(c_BxSxD, positions_BxS) for block in self.blocks]

    def _mask(self, ctx_pos, ctx_valid, anchor_pos, ctx_seg, anchor_seg) -> jax.Array:
        """Boolean [B, N*K, S + N*K]: windowed, valid, same-segment context slots strictly
        before the anchor, plus the query's own block (bidirectional)."""
        b, n = anchor_pos.shape
        k = self.cfg.block_size
        p_Bx1xN = anchor_pos[:, :, None]
        pos_BxS = ctx_pos[:, None, :]
        ctx_BxNxS = ctx_valid[:, None, :] & (pos_BxS < p_Bx1xN)
        ctx_BxNxS &= pos_BxS >= p_Bx1xN - self.cfg.window
        if ctx_seg is not None:
            ctx_BxNxS &= ctx_seg[:, None, :] == anchor_seg[:, :, None]
        ctx_BxTxS = jnp.repeat(ctx_BxNxS, k, axis=1)
        block_T = jnp.repeat(jnp.arange(n), k)
        own_TxT = block_T[:, None] == block_T[None, :]
        own_BxTxT = jnp.broadcast_to(own_TxT, (b, n * k, n * k))
        return jnp.concatenate([ctx_BxTxS, own_BxTxT], axis=-1)

    def draft(
        self,
        frozen: FrozenTarget,
        ctx_kv: ContextKV,
        ctx_pos_BxS: jax.Array,
        ctx_valid_BxS: jax.Array,
        anchors_BxN: jax.Array,
        anchor_pos_BxN: jax.Array,
        ctx_segment_BxS: jax.Array | None = None,
        anchor_segment_BxN: jax.Array | None = None,
    ) -> DrafterOutput:
        """One parallel forward over N blocks of K draft positions per row (module docstring).

        ctx_kv: `context_kv(feats, ctx_pos)`; ctx_valid: bool [B, S] (False = empty slot);
        anchors: int [B, N] the last accepted tokens, at positions anchor_pos [B, N]; segment
        ids (both or neither) keep a block inside its packed document.
        """
        c, t = self.cfg, self.target
        k, v, d = c.block_size, t.vocab_size, t.d_model
        dtype = jnp.dtype(t.compute_dtype)
        b, s = ctx_pos_BxS.shape
        if anchors_BxN.ndim != 2 or anchors_BxN.shape[0] != b:
            raise _shape_error("anchors", anchors_BxN.shape, (b, "N"))
        n = anchors_BxN.shape[1]
        if anchor_pos_BxN.shape != (b, n):
            raise _shape_error("anchor_pos", anchor_pos_BxN.shape, (b, n))
        if ctx_valid_BxS.shape != (b, s):
            raise _shape_error("ctx_valid", ctx_valid_BxS.shape, (b, s))
        if (ctx_segment_BxS is None) != (anchor_segment_BxN is None):
            raise ValueError("ctx_segment and anchor_segment must be given together")
        if ctx_segment_BxS is not None:
            if ctx_segment_BxS.shape != (b, s):
                raise _shape_error("ctx_segment", ctx_segment_BxS.shape, (b, s))
            if anchor_segment_BxN.shape != (b, n):
                raise _shape_error("anchor_segment", anchor_segment_BxN.shape, (b, n))
        if len(ctx_kv) != c.num_layers:
            raise ValueError(f"ctx_kv has {len(ctx_kv)} layers; drafter has {c.num_layers}")
        kv_shape = (b, s, c.num_heads, d // c.num_heads)
        for layer, kv in enumerate(ctx_kv):
            for name in ("k", "v"):
                if kv[name].shape != kv_shape:
                    raise _shape_error(f"ctx_kv[{layer}][{name!r}]", kv[name].shape, kv_shape)
        if frozen.embedding.shape != (v, d) or frozen.head.shape != (d, v):
            raise ValueError(
                f"frozen embedding {tuple(frozen.embedding.shape)} / head "
                f"{tuple(frozen.head.shape)} must be [V, D] / [D, V] = {(v, d)} / {(d, v)}"
            )
        check_token_range("anchors", anchors_BxN, v)
        # stop_gradient again: a FrozenTarget built by hand must not train the backbone either
        embedding = jax.lax.stop_gradient(frozen.embedding)
        head = jax.lax.stop_gradient(frozen.head)

        anchor_BxNx1xD = jnp.take(embedding, anchors_BxN, axis=0)[:, :, None, :].astype(dtype)
        mask_BxNxKxD = jnp.broadcast_to(self.mask_embedding.astype(dtype), (b, n, k - 1, d))
        x_BxTxD = jnp.concatenate([anchor_BxNx1xD, mask_BxNxKxD], axis=2).reshape(b, n * k, d)
        positions_BxT = (anchor_pos_BxN[:, :, None] + jnp.arange(k)).reshape(b, n * k)
        mask_BxTxSt = self._mask(
            ctx_pos_BxS,
            ctx_valid_BxS.astype(bool),
            anchor_pos_BxN,
            ctx_segment_BxS,
            anchor_segment_BxN,
        )
        for block, kv in zip(self.blocks, ctx_kv, strict=True):
            x_BxTxD = block(x_BxTxD, positions_BxT, kv, mask_BxTxSt)
        hidden_BxTxD = self.final_norm(x_BxTxD)
        base_BxTxV = jnp.einsum(
            "btd,dv->btv",
            hidden_BxTxD.astype(dtype),
            head.astype(dtype),
            preferred_element_type=jnp.float32,
        )
        conf_BxT = self.confidence(hidden_BxTxD.astype(jnp.float32))[..., 0]
        return DrafterOutput(
            base_logits=base_BxTxV.reshape(b, n, k, v),
            hidden=hidden_BxTxD.reshape(b, n, k, d),
            confidence_logits=conf_BxT.astype(jnp.float32).reshape(b, n, k),
        )

    def __call__(
        self,
        frozen: FrozenTarget,
        feats_BxSxF: jax.Array,
        ctx_pos_BxS: jax.Array,
        ctx_valid_BxS: jax.Array,
        anchors_BxN: jax.Array,
        anchor_pos_BxN: jax.Array,
        ctx_segment_BxS: jax.Array | None = None,
        anchor_segment_BxN: jax.Array | None = None,
    ) -> DrafterOutput:
        """`draft(frozen, context_kv(feats, ctx_pos), ...)`: the training / init path."""
        if self.cfg.uses_markov:
            self.markov()  # create markov/{u, w} at init; they act outside this forward
        if self.cfg.confidence_input == "prev_token":
            _ = self.confidence_prev  # created at init; read by `confidence_logits`
        return self.draft(
            frozen,
            self.context_kv(feats_BxSxF, ctx_pos_BxS),
            ctx_pos_BxS,
            ctx_valid_BxS,
            anchors_BxN,
            anchor_pos_BxN,
            ctx_segment_BxS,
            anchor_segment_BxN,
        )
