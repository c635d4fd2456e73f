"""One decoder block (`Block`), its per-call inputs, the FFN kinds, and the layer-scan body.

    x <- x + Attn(RMSNorm(x));  x <- x + FFN(RMSNorm(x))        (plain residual, [B, T, D])

Seams, extended by config without rewriting the block:
- `Block.pre_attention`: the per-layer memory slot before attention (Engram:
  `h <- h + Engram(h, ids)` at chosen layers; its per-token ids ride in `BlockInputs.extras`).
- `Block.residual`: the one residual connection used around both sub-layers, a step of the
  model's residual stream (`v41jax.model.residual_stream`): plain `x <- x + F(RMSNorm(x))`,
  or mHC's n-stream mixing `x <- H_res x + H_post^T F(RMSNorm(H_pre x))` (state
  [B, T, n, C]; the mix params `attn_mix` / `ffn_mix` live here). The sub-layers get their
  normalised input from the step. With `cfg.mhc.form == "single_pass"` the state is a
  `SinglePassState` and the pass normalises, so `attn_norm`/`ffn_norm` hold only their
  `scale` (`NormScale`), which the step hands to the pass.
- `make_ffn`: FFN modules keyed by a kind string (`FFN_KINDS`): "dense" (SwiGLU) or "moe"
  (`v41jax.model.moe.MoE`), chosen per layer by `ffn_kind_for_layer`.

Each block also returns its features' per-layer values (`LayerStats`: mHC's H_res of both
sub-layers, an MoE layer's `MoEStats`); the model reduces them over depth to its auxiliary
loss and metrics (`feature_outputs`, `ModelOutput.aux_loss` / `.metrics`).

`ScanBlock` is the same block as the body of `nn.scan` over a run of identical layers
(`v41jax.model.layout`): carry (residual state, the run's stacked KV cache or None), scanned
input the layer's index within the run, output (its hidden state when the run holds a tap,
else None; its `LayerStats`), stacked over the run.
The sub-layer outputs are tagged `ATTN_OUT` / `FFN_OUT` for the remat policies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.config import ModelConfig, ParamGroup
from v41jax.engram import Engram
from v41jax.engram.params import table_param_group
from v41jax.engram.tree_keys import engram_ids_key, engram_rows_key
from v41jax.mhc import MHCResidual, composite_gain
from v41jax.mhc.layer import NormScale
from v41jax.model.attention import Attention, AttentionLayout, KVCache, PackedRows
from v41jax.model.layers import RMSNorm, SwiGLU
from v41jax.model.metric import Metric
from v41jax.model.moe import MoE, expert_width, is_moe_layer, moe_summary
from v41jax.model.remat import ATTN_OUT, FFN_OUT, tag
from v41jax.model.residual_stream import RESIDUAL_AXES, residual_stream

# One block's feature values for the model's output, {} for a plain block:
#   "h_res": (attention's, FFN's) H_res [B, T, n, n] with mHC (no gradient is taken of them)
#   "moe":   the layer's `MoEStats` at an MoE layer
LayerStats = dict[str, Any]


def feature_outputs(cfg: ModelConfig, stats: list[LayerStats]) -> tuple[jax.Array, dict]:
    """(aux_loss float32 [], metrics {name: Metric of float32 []}) of one forward pass from
    its blocks' `LayerStats` in depth order: what the features add to the training loss and
    log; each `Metric` says how microbatches combine it (`v41jax.model.metric`).

    MoE: aux_loss = `moe.aux_loss_weight * moe_aux_loss` and `moe_summary`'s metrics.
    mHC: `mhc_forward_gain` / `mhc_backward_gain`, the worst token's composite gain of the
    H_res product across depth (`composite_gain`; diagnostics only, no gradient).
    """
    aux_loss, metrics = jnp.zeros((), jnp.float32), {}
    moe = moe_summary([s["moe"] for s in stats if "moe" in s])
    if moe:
        aux_loss = cfg.moe.aux_loss_weight * moe["moe_aux_loss"]
        metrics.update({k: Metric(v, "mean") for k, v in moe.items()})  # batch statistics
    h_res = [h for s in stats for h in s.get("h_res", ())]
    if h_res:
        gains = composite_gain([jax.lax.stop_gradient(h) for h in h_res])
        metrics["mhc_forward_gain"] = Metric(gains["forward_amax"], "max")  # worst token
        metrics["mhc_backward_gain"] = Metric(gains["backward_amax"], "max")
    return aux_loss, metrics


def feature_param_groups(cfg: ModelConfig, table_optimizer: str = "adam") -> tuple[ParamGroup, ...]:
    """The optimizer groups the features ask for, to go first (first match wins) before the
    run's own `optim.param_groups`: Engram's tables (`table_param_group`, trained by
    `table_optimizer`). () for none."""
    return (table_param_group(cfg.engram, table_optimizer),) if cfg.engram.enabled else ()


class BlockInputs(NamedTuple):
    """Per-call inputs shared by every block (built once by `Transformer`).

    `extras` carries per-token side inputs of later modules (e.g. Engram hash ids [B, T, N]),
    keyed by name; the plain block ignores it. `packed`: the tokens are [1, N], packed rows
    of the KV cache (`v41jax.model.attention.PackedRows`); None for [B, T] tokens.
    """

    positions_BxT: jax.Array
    layout: AttentionLayout
    segment_ids_BxT: jax.Array | None = None
    cache_index_B: jax.Array | None = None
    extras: Mapping[str, jax.Array] = {}
    packed: PackedRows | None = None


def layer_dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
    return jnp.dtype(cfg.compute_dtype), jnp.dtype(cfg.param_dtype)


def _out_init_std(cfg: ModelConfig) -> float:
    """Projections into the residual stream start at `init_std / sqrt(2 L)` (GPT-2) so the
    stream's variance does not grow with depth at init."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def _dense_ffn(cfg: ModelConfig) -> nn.Module:
    dtype, param_dtype = layer_dtypes(cfg)
    return SwiGLU(
        d_ff=cfg.d_ff,
        init_std=cfg.init_std,
        out_init_std=_out_init_std(cfg),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def _moe_ffn(cfg: ModelConfig) -> nn.Module:
    dtype, param_dtype = layer_dtypes(cfg)
    width, out_std = expert_width(cfg), _out_init_std(cfg)
    return MoE(cfg.moe, width, cfg.init_std, out_std, dtype, param_dtype, return_stats=True)


FFN_KINDS: dict[str, Callable[[ModelConfig], nn.Module]] = {"dense": _dense_ffn, "moe": _moe_ffn}


def ffn_kind_for_layer(cfg: ModelConfig, layer: int) -> str:
    """FFN kind of block `layer`: "moe" at the MoE layers of `cfg.moe`, else "dense"."""
    return "moe" if is_moe_layer(cfg, layer) else "dense"


def make_ffn(cfg: ModelConfig, kind: str = "dense") -> nn.Module:
    """The FFN module of kind `kind` (one of `FFN_KINDS`): [B, T, D] -> [B, T, D]
    ("moe": -> ([B, T, D], `MoEStats`))."""
    if kind not in FFN_KINDS:
        raise ValueError(f"unknown FFN kind {kind!r}; known: {sorted(FFN_KINDS)}")
    return FFN_KINDS[kind](cfg)


class Block(nn.Module):
    """One pre-norm decoder block: [B, T, D] -> ([B, T, D], new KV cache or None,
    `LayerStats`)."""

    cfg: ModelConfig
    layer_index: int
    ffn_kind: str = "dense"

    def setup(self):
        c = self.cfg
        dtype, param_dtype = layer_dtypes(c)
        self.stream = residual_stream(c)
        # single_pass: the pre-norms are folded into the mHC pass; only their scales remain
        norm = (
            functools.partial(NormScale, c.d_model, param_dtype)
            if self.stream.folds_norms
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
            qkv_bias=c.attention_bias,
            qk_norm=c.qk_norm,
            norm_eps=c.norm_eps,
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

    def __call__(
        self, x_BxTxD: Any, inputs: BlockInputs, cache: KVCache | None = None
    ) -> tuple[Any, KVCache | None, LayerStats]:
        x_BxTxD = self.pre_attention(x_BxTxD, inputs)

        def attention(h):  # h: the normalised input
            y, new_cache = self.attn(
                h, inputs.positions_BxT, inputs.layout, cache, inputs.cache_index_B, inputs.packed
            )
            return tag(y, ATTN_OUT), new_cache

        x_BxTxD, new_cache, h_res_attn = self.residual(x_BxTxD, attention, "attn")

        def ffn(h):
            y = self.ffn(h)
            y, moe = y if self.ffn_kind == "moe" else (y, None)
            return tag(y, FFN_OUT), moe

        x_BxTxD, moe, h_res_ffn = self.residual(x_BxTxD, ffn, "ffn")
        stats: LayerStats = {} if moe is None else {"moe": moe}
        if h_res_attn is not None:
            stats["h_res"] = (h_res_attn, h_res_ffn)
        return x_BxTxD, new_cache, stats

    def pre_attention(self, x_BxTxD: Any, inputs: BlockInputs) -> Any:
        """Per-layer memory before attention: `h <- h + Engram(h, ids)` at the layers in
        `cfg.engram.layer_ids` (ids from `inputs.extras[engram_ids_key(layer)]`), else h.
        The stream's state is updated through `stream.apply` (single_pass: materialised
        first, its pending update applied)."""
        if self.layer_index not in self.cfg.engram.layer_ids:
            return x_BxTxD
        return self.stream.apply(x_BxTxD, lambda x: self._add_engram(x, inputs))

    def _add_engram(self, x_BxTxD: jax.Array, inputs: BlockInputs) -> jax.Array:
        key = engram_ids_key(self.layer_index)
        if key not in inputs.extras:
            raise ValueError(
                f"layer {self.layer_index} has an Engram module but extras has no {key!r} "
                f"(hash ids [B, T, {self.cfg.engram.num_heads_total}]); got {sorted(inputs.extras)}"
            )
        rows = inputs.extras.get(engram_rows_key(self.layer_index))
        delta_BxTxD = self.engram(x_BxTxD, inputs.extras[key], rows)
        return nn.with_logical_constraint(
            x_BxTxD + delta_BxTxD.astype(x_BxTxD.dtype), RESIDUAL_AXES
        )

    def residual(
        self,
        x: Any,
        sublayer: Callable[[jax.Array], tuple[jax.Array, Any]],
        site: str,
    ) -> tuple[Any, Any, jax.Array | None]:
        """The residual connection around a sub-layer F, one `stream.step` (see
        `v41jax.model.residual_stream`); returns (new state, aux, H_res).

        `sublayer` maps its normalised [B, T, C] input to (output, aux) (aux: the new KV
        cache, the FFN's `MoEStats`, or None); the step applies the site's norm (or, folded,
        passes its scale to the mHC pass). With mHC, H_res [B, T, n, n] is returned (None
        for the plain stream) and sown as intermediates/h_res, for the composite-gain
        diagnostics.
        """
        mix = (self.attn_mix if site == "attn" else self.ffn_mix) if self.cfg.mhc.enabled else None
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        x_new, aux, h_res_BxTxNxN = self.stream.step(x, sublayer, mix, norm)
        if h_res_BxTxNxN is not None:
            self.sow("intermediates", "h_res", h_res_BxTxNxN)
        return x_new, aux, h_res_BxTxNxN


def write_rows(stack: jax.Array, layer_cache: jax.Array, j: jax.Array, start_B, t: int):
    """Copy the T entries row b wrote at slots start[b] .. of one layer's updated cache
    [B, S, G, K] into layer j of the run's stacked cache [L, B, S, G, K].

    Only these T slots change, so the stack is updated in place (a scatter into the scan
    carry) instead of writing back a whole [B, S, G, K] layer per layer per step.
    """
    b = stack.shape[1]
    slots_BxT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)
    rows_B1 = jnp.arange(b, dtype=jnp.int32)[:, None]
    new_BxTxGxK = jnp.take_along_axis(layer_cache, slots_BxT[:, :, None, None], axis=1)
    # one scatter on the stack's own axes (a vmap over its batch axis would transpose the
    # whole stack); slots past S are dropped, as the caller guarantees start + T <= S
    return stack.at[j, rows_B1, slots_BxT].set(new_BxTxGxK, mode="drop")


def write_packed_rows(stack: jax.Array, layer_cache: jax.Array, j: jax.Array, packed: PackedRows):
    """`write_rows` for packed tokens: copy the entries at (row_N, slot_N) of one layer's
    updated cache [B, S, G, K] into layer j of the stack [L, B, S, G, K] (padding dropped)."""
    b = layer_cache.shape[0]
    new_NxGxK = layer_cache[jnp.minimum(packed.row_N, b - 1), packed.slot_N]
    return stack.at[j, packed.row_N, packed.slot_N].set(new_NxGxK, mode="drop")


class ScanBlock(Block):
    """`Block` as an `nn.scan` body over a run of identical layers (module docstring).

    `(carry, j, inputs) -> (carry, (hidden or None, LayerStats))`: carry = (residual state,
    stacked cache {"k", "v"}: [L, B, S, G, K] or None), j int32 [] the layer's index in the
    run. With `tap`, the layer's [B, T, D] hidden state is output (stacked to [L, B, T, D]);
    the stats are stacked likewise ([L, ...] leaves).
    """

    tap: bool = False

    def __call__(self, carry: tuple[Any, KVCache | None], j: jax.Array, inputs: BlockInputs):
        x, stack = carry
        layer_cache = None
        if stack is not None:
            layer_cache = jax.tree.map(
                lambda c: jax.lax.dynamic_index_in_dim(c, j, 0, False), stack
            )
        x, new_cache, stats = Block.__call__(self, x, inputs, layer_cache)
        if stack is not None and inputs.packed is not None:
            stack = {n: write_packed_rows(stack[n], new_cache[n], j, inputs.packed) for n in stack}
        elif stack is not None:
            t = inputs.positions_BxT.shape[1]
            stack = {
                n: write_rows(stack[n], new_cache[n], j, inputs.cache_index_B, t) for n in stack
            }
        return (x, stack), (self.stream.hidden(x) if self.tap else None, stats)
