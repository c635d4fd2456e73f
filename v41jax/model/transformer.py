"""Decoder-only transformer: token embedding, `num_layers` pre-norm blocks, final norm, LM head.

    h_{-1} = Embed(tokens)
    h_l    = Block_l(h_{l-1})   with  x <- x + Attn(RMSNorm(x));  x <- x + FFN(RMSNorm(x))
    logits = Head(RMSNorm(h_{L-1}))          (tied: h E^T; untied: h W_head), float32

Seams for later issues, extended by config without rewriting the block:
- `Block.pre_attention`: the per-layer memory slot before attention (Engram:
  `h <- h + Engram(h, ids)` at chosen layers; its per-token ids ride in `BlockInputs.extras`).
- `Block.residual`: the one residual connection used around both sub-layers. It receives the
  sub-layer as a function so mHC can replace it with n-stream mixing
  (`x <- H_res x + H_post^T F(H_pre x)`, residual state [B, T, n, C]).
  With `cfg.mhc.form == "single_pass"` the state between sub-layers is a `SinglePassState`
  (streams, lagged pre-mapping, pending update; see `v41jax.mhc.layer`): the sub-layers then
  get an input that is already mixed and normalised, so `attn_norm`/`ffn_norm` hold only
  their `scale` (`NormScale`), which the single-pass step applies; the readout before the
  head is RMSNorm(A_{L-1} X_L; final_norm.scale) from the last pass.
- `make_ffn`: FFN modules keyed by a kind string (`FFN_KINDS`): "dense" (SwiGLU) or "moe"
  (`v41jax.model.moe.MoE`), chosen per layer by `ffn_kind_for_layer`.
Layers are a plain Python loop (not `nn.scan`) because they will differ per layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.engram import Engram
from v41jax.mhc import MHCResidual, expand_streams, reduce_streams
from v41jax.mhc.layer import (
    NormScale,
    SinglePassState,
    single_pass_init,
    single_pass_materialize,
    single_pass_readout,
)
from v41jax.model.attention import Attention, AttentionLayout, KVCache
from v41jax.model.layers import Embed, RMSNorm, SwiGLU, normal_init
from v41jax.model.moe import MoE, expert_width, is_moe_layer

RESIDUAL_AXES = ("batch", "length", "act_embed")
STREAM_AXES = ("batch", "length", "act_streams", "act_embed")  # mHC state [B, T, n, C]
ENGRAM_IDS_PREFIX = "engram_ids_"


def engram_ids_key(layer: int) -> str:
    """Key in `extras` (and in training batches) of layer `layer`'s Engram hash ids
    int32 [B, T, (max_ngram_size - 1) * n_head_per_ngram]."""
    return f"{ENGRAM_IDS_PREFIX}{layer}"


class ModelOutput(NamedTuple):
    """`logits` float32 [B, T, V]; `hidden` {layer: [B, T, D]} for the requested layers
    (-1 = embeddings, l = output of block l, before the final norm); `cache` the updated
    per-layer KV caches when a cache was passed, else None."""

    logits: jax.Array
    hidden: dict[int, jax.Array]
    cache: list[KVCache] | None


class BlockInputs(NamedTuple):
    """Per-call inputs shared by every block (built once by `Transformer`).

    `extras` carries per-token side inputs of later modules (e.g. Engram hash ids [B, T, N]),
    keyed by name; the plain block ignores it.
    """

    positions_BxT: jax.Array
    layout: AttentionLayout
    segment_ids_BxT: jax.Array | None = None
    cache_index_B: jax.Array | None = None
    extras: Mapping[str, jax.Array] = {}


def _dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    return jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)


def _out_init_std(cfg: ModelConfig) -> float:
    """Projections into the residual stream start at `init_std / sqrt(2 L)` (GPT-2) so the
    stream's variance does not grow with depth at init."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def _dense_ffn(cfg: ModelConfig) -> nn.Module:
    dtype, param_dtype = _dtypes(cfg)
    return SwiGLU(
        d_ff=cfg.d_ff,
        init_std=cfg.init_std,
        out_init_std=_out_init_std(cfg),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def _moe_ffn(cfg: ModelConfig) -> nn.Module:
    dtype, param_dtype = _dtypes(cfg)
    return MoE(cfg.moe, expert_width(cfg), cfg.init_std, _out_init_std(cfg), dtype, param_dtype)


FFN_KINDS: dict[str, Callable[[ModelConfig], nn.Module]] = {"dense": _dense_ffn, "moe": _moe_ffn}


def ffn_kind_for_layer(cfg: ModelConfig, layer: int) -> str:
    """FFN kind of block `layer`: "moe" at the MoE layers of `cfg.moe`, else "dense"."""
    return "moe" if is_moe_layer(cfg, layer) else "dense"


def make_ffn(cfg: ModelConfig, kind: str = "dense") -> nn.Module:
    """The FFN module of kind `kind` (one of `FFN_KINDS`): [B, T, D] -> [B, T, D]."""
    if kind not in FFN_KINDS:
        raise ValueError(f"unknown FFN kind {kind!r}; known: {sorted(FFN_KINDS)}")
    return FFN_KINDS[kind](cfg)


class Block(nn.Module):
    """One pre-norm decoder block: [B, T, D] -> ([B, T, D], new KV cache or None)."""

    cfg: ModelConfig
    layer_index: int
    ffn_kind: str = "dense"

    def setup(self):
        c = self.cfg
        dtype, param_dtype = _dtypes(c)
        # single_pass: the pre-norms are folded into the mHC pass; only their scales remain
        norm = (
            functools.partial(NormScale, c.d_model, param_dtype)
            if self._folded_norms
            else functools.partial(RMSNorm, eps=c.norm_eps, param_dtype=param_dtype)
        )
        self.attn_norm = norm()
        self.attn = Attention(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.resolved_head_dim,
            rope_theta=c.rope_theta,
            init_std=c.init_std,
            out_init_std=_out_init_std(c),
            dtype=dtype,
            param_dtype=param_dtype,
            impl=c.attention_impl,
            block_size=c.attention_block_size,
        )
        self.ffn_norm = norm()
        self.ffn = make_ffn(c, self.ffn_kind)
        if self.layer_index in c.engram.layer_ids:
            self.engram = Engram(
                c.engram,
                layer_id=self.layer_index,
                hidden_size=c.d_model,
                # with mHC, one key branch per residual stream ([B, T, n, C] hidden states)
                num_branches=max(c.mhc.n_streams, 1),
                dtype=dtype,
                param_dtype=param_dtype,
            )
        if c.mhc.enabled:
            self.attn_mix = MHCResidual(c.mhc, c.d_model, c.norm_eps)
            self.ffn_mix = MHCResidual(c.mhc, c.d_model, c.norm_eps)

    @property
    def _folded_norms(self) -> bool:
        return self.cfg.mhc.enabled and self.cfg.mhc.form == "single_pass"

    def _pre_norm(self, norm: nn.Module, h: jax.Array) -> jax.Array:
        return h if self._folded_norms else norm(h)

    def __call__(
        self, x_BxTxD: Any, inputs: BlockInputs, cache: KVCache | None = None
    ) -> tuple[Any, KVCache | None]:
        x_BxTxD = self.pre_attention(x_BxTxD, inputs)

        def attention(h):
            return self.attn(
                self._pre_norm(self.attn_norm, h),
                inputs.positions_BxT,
                inputs.layout,
                cache,
                inputs.cache_index_B,
            )

        x_BxTxD, new_cache = self.residual(x_BxTxD, attention, "attn")

        def ffn(h):
            return self.ffn(self._pre_norm(self.ffn_norm, h)), None

        x_BxTxD, _ = self.residual(x_BxTxD, ffn, "ffn")
        return x_BxTxD, new_cache

    def pre_attention(self, x_BxTxD: Any, inputs: BlockInputs) -> Any:
        """Per-layer memory before attention: `h <- h + Engram(h, ids)` at the layers in
        `cfg.engram.layer_ids` (ids from `inputs.extras[engram_ids_key(layer)]`), else h.
        A `SinglePassState` is materialised first (its pending update applied)."""
        if self.layer_index not in self.cfg.engram.layer_ids:
            return x_BxTxD
        if isinstance(x_BxTxD, SinglePassState):
            state = single_pass_materialize(x_BxTxD)
            return state._replace(x=self.pre_attention(state.x, inputs))
        key = engram_ids_key(self.layer_index)
        if key not in inputs.extras:
            raise ValueError(
                f"layer {self.layer_index} has an Engram module but extras has no {key!r} "
                f"(hash ids [B, T, {self.cfg.engram.num_heads_total}]); got {sorted(inputs.extras)}"
            )
        delta_BxTxD = self.engram(x_BxTxD, inputs.extras[key])
        return nn.with_logical_constraint(
            x_BxTxD + delta_BxTxD.astype(x_BxTxD.dtype), RESIDUAL_AXES
        )

    def residual(
        self,
        x: jax.Array,
        sublayer: Callable[[jax.Array], tuple[jax.Array, Any]],
        site: str,
    ) -> tuple[Any, Any]:
        """The residual connection around a sub-layer F; returns (new state, aux).

        Plain: `x <- x + F(x)` on [B, T, C]. mHC (`cfg.mhc.n_streams >= 1`): the state is
        [B, T, n, C] and `x <- H_res x + H_post^T F(H_pre x)`; H_res [B, T, n, n] is sown
        as intermediates/h_res for the composite-gain diagnostics. `sublayer` maps a
        [B, T, C] input to (output, aux) (aux: the new KV cache or None). Form "single_pass":
        x is a `SinglePassState` and the site's norm scale goes to the mHC pass.
        """
        if not self.cfg.mhc.enabled:
            y, aux = sublayer(x)
            return nn.with_logical_constraint(x + y.astype(x.dtype), RESIDUAL_AXES), aux
        mix = self.attn_mix if site == "attn" else self.ffn_mix
        if self._folded_norms:
            scale = (self.attn_norm if site == "attn" else self.ffn_norm)()
            state, aux, h_res_BxTxNxN = mix(x, sublayer, scale)
            self.sow("intermediates", "h_res", h_res_BxTxNxN)
            return state._replace(x=nn.with_logical_constraint(state.x, STREAM_AXES)), aux
        x_new, aux, h_res_BxTxNxN = mix(x, sublayer)
        self.sow("intermediates", "h_res", h_res_BxTxNxN)
        return nn.with_logical_constraint(x_new, STREAM_AXES), aux


class Transformer(nn.Module):
    """The decoder-only LM of `cfg` (see the module docstring for the equations)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        *,
        hidden_layers: tuple[int, ...] = (),
        cache: list[KVCache] | None = None,
        cache_index: jax.Array | None = None,
        extras: Mapping[str, jax.Array] | None = None,
    ) -> ModelOutput:
        """Forward pass over int tokens [B, T].

        positions_BxT: RoPE positions; default `arange(T)` (plus `cache_index` with a cache).
            Causality follows token order (cache slots with a cache), never these values,
            so positions that restart per packed document are fine.
        segment_ids_BxT: packed-document ids; attention stays within a segment when
            `cfg.segment_mask` (not allowed together with a cache).
        hidden_layers: layers whose outputs go into `ModelOutput.hidden` (-1 = embeddings).
        cache, cache_index: per-layer KV caches (see `generate.init_cache`) and int32 [B]
            first write slots (default 0). Queries then sit at slots `cache_index + t`.
        extras: per-token side inputs for later modules, passed to every block.
        """
        c = self.cfg
        dtype, param_dtype = _dtypes(c)
        b, t = tokens_BxT.shape
        bad = [i for i in hidden_layers if not -1 <= i < c.num_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range [-1, {c.num_layers - 1}]")

        arange_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cache is None:
            if positions_BxT is None:
                positions_BxT = arange_BxT
            use_segments = c.segment_mask and segment_ids_BxT is not None
            seg = segment_ids_BxT if use_segments else None
            layout = AttentionLayout(arange_BxT, arange_BxT, seg, seg)
            caches: list[KVCache | None] = [None] * c.num_layers
        else:
            if len(cache) != c.num_layers:
                raise ValueError(f"cache has {len(cache)} layers, model has {c.num_layers}")
            if segment_ids_BxT is not None:
                raise ValueError("segment_ids are not supported with a KV cache")
            if cache_index is None:
                cache_index = jnp.zeros((b,), jnp.int32)
            cache_index = jnp.asarray(cache_index, jnp.int32)
            q_slots_BxT = cache_index[:, None] + arange_BxT
            if positions_BxT is None:
                positions_BxT = q_slots_BxT
            s = cache[0]["k"].shape[1]
            kv_slots_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            layout = AttentionLayout(q_slots_BxT, kv_slots_BxS)
            caches = list(cache)

        inputs = BlockInputs(
            positions_BxT=positions_BxT,
            layout=layout,
            segment_ids_BxT=segment_ids_BxT,
            cache_index_B=cache_index,
            extras=dict(extras or {}),
        )
        embed = Embed(
            c.vocab_size,
            c.d_model,
            init_std=c.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            name="embed",
        )
        x_BxTxD = nn.with_logical_constraint(embed(tokens_BxT), RESIDUAL_AXES)
        hidden = {-1: x_BxTxD} if -1 in hidden_layers else {}
        if c.mhc.enabled:  # n residual streams from here to the final norm
            x_BxTxD = nn.with_logical_constraint(
                expand_streams(x_BxTxD, c.mhc.n_streams), STREAM_AXES
            )
        single_pass = c.mhc.enabled and c.mhc.form == "single_pass"
        if single_pass:  # lagged state: X_0 with the one-hot pre-mapping
            x_BxTxD = single_pass_init(x_BxTxD)

        block_cls = nn.remat(Block) if c.remat_policy != "none" else Block
        new_caches = []
        for i in range(c.num_layers):
            block = block_cls(c, i, ffn_kind_for_layer(c, i), name=f"block_{i}")
            x_BxTxD, layer_cache = block(x_BxTxD, inputs, caches[i])
            new_caches.append(layer_cache)
            if i in hidden_layers:
                if single_pass:
                    hidden[i] = reduce_streams(single_pass_materialize(x_BxTxD).x)
                else:
                    hidden[i] = reduce_streams(x_BxTxD) if c.mhc.enabled else x_BxTxD

        if single_pass:  # the last pass writes the head's normalised input
            scale = NormScale(c.d_model, param_dtype, name="final_norm")()
            _, x_BxTxD = single_pass_readout(x_BxTxD, scale, c.norm_eps, x_BxTxD.x.dtype)
        else:
            if c.mhc.enabled:
                x_BxTxD = reduce_streams(x_BxTxD)
            x_BxTxD = RMSNorm(eps=c.norm_eps, param_dtype=param_dtype, name="final_norm")(x_BxTxD)
        if c.tie_embeddings:
            logits_BxTxV = embed.attend(x_BxTxD)
        else:
            w_head = self.param(
                "head",
                normal_init(c.init_std, ("embed", "vocab")),
                (c.d_model, c.vocab_size),
                param_dtype,
            )
            logits_BxTxV = jnp.einsum(
                "btd,dv->btv",
                x_BxTxD.astype(dtype),
                w_head.astype(dtype),
                preferred_element_type=jnp.float32,
            )
        logits_BxTxV = nn.with_logical_constraint(logits_BxTxV, ("batch", "length", "act_vocab"))
        return ModelOutput(logits_BxTxV, hidden, new_caches if cache is not None else None)


# ----------------------------------------------------------------------------- helpers


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Initial params of `Transformer(cfg)` (the tree under "params"), each leaf boxed as
    `nn.LogicallyPartitioned`. Jitted and cached per config; for abstract shapes use
    `jax.eval_shape(functools.partial(init_params, cfg), rng)`."""
    return _init_params_jit(cfg, rng)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _init_params_jit(cfg: ModelConfig, rng: jax.Array) -> Any:
    # Engram layers need hash ids to trace; id 0 is a valid row of every head's table.
    extras = {
        engram_ids_key(layer): jnp.zeros((1, 1, cfg.engram.num_heads_total), jnp.int32)
        for layer in (cfg.engram.layer_ids if cfg.engram.enabled else ())
    }
    return Transformer(cfg).init(rng, jnp.zeros((1, 1), jnp.int32), extras=extras)["params"]


def count_params(params: Any) -> int:
    """Number of scalars in a (boxed or plain) param tree."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params)))
