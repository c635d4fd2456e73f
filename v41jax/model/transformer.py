"""Decoder-only transformer: token embedding, `num_layers` pre-norm blocks, final norm, LM head.

    x_0    = stream.expand(Embed(tokens))
    x_l+1  = Block_l(x_l)    each sub-layer F a stream step, plain: x <- x + F(RMSNorm(x))
    h      = stream.read_out(x_L, final_norm)                     [B, T, D]
    logits = Head(h)          (tied: h E^T; untied: h W_head), float32

The residual stream (plain, mHC's n streams, or mHC single-pass; how the embedding becomes
the state, the step around each sub-layer, the read-out) is `v41jax.model.residual_stream`;
the block and its seams (Engram before attention, FFN kinds) `v41jax.model.block`; the final
norm and output projection (tied or untied, full or chunked logits) `v41jax.model.head`.

Layers run as segments (`v41jax.model.layout.layer_segments`): with `cfg.scan_layers` (the
default) each maximal run of identical consecutive blocks is one `nn.scan` named
"layers_{a}_{b}" (params stacked [L_run, ...] on the logical axis "layers"; sown
intermediates stacked likewise; the residual state, incl. mHC's `SinglePassState`, is the
carry; positions, layout and extras are broadcast), so compile time and HLO size stay
roughly flat in depth. Blocks that differ (Engram layers, an MoE/dense FFN boundary,
single_pass layer 0) split the runs; a run of one is a plain "block_{i}", as is every layer
with scan_layers=False. `cfg.remat_policy` wraps each block in `nn.remat` (inside the scan
body) with a named policy (`v41jax.model.remat`).

Features hand their auxiliary losses and metrics up through the output: every block returns
its `LayerStats` (scanned runs stack them), and `feature_outputs` reduces them in depth order
to `ModelOutput.aux_loss` (MoE's weighted balance loss) and `ModelOutput.metrics` (MoE
routing statistics, mHC composite gains), so a training loop adds the one and logs the other
without knowing which features are on.

KV cache: a dict {segment name: {"k", "v"}}, [L_run, B, S, G, K] for a scanned run (the scan
carry, written in place: only the T new slots of each layer) and [B, S, G, K] for a block
(`v41jax.decode.generate.init_cache` builds it for the model's segments).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.engram import flat_row_ids
from v41jax.engram.host_rows import HostRows, read_host_rows
from v41jax.engram.tree_keys import engram_ids_key, engram_rows_key
from v41jax.model.attention import AttentionLayout, KVCache, PackedRows
from v41jax.model.block import (  # noqa: F401 (re-exported: the model's public names)
    FFN_KINDS,
    Block,
    BlockInputs,
    ScanBlock,
    feature_outputs,
    ffn_kind_for_layer,
    layer_dtypes,
    make_ffn,
)
from v41jax.model.head import Head
from v41jax.model.layers import Embed
from v41jax.model.layout import Segment, layer_segments
from v41jax.model.metric import Metric
from v41jax.model.remat import remat_block
from v41jax.model.residual_stream import RESIDUAL_AXES, ResidualStream, residual_stream

Cache = dict[str, KVCache]


class ModelOutput(NamedTuple):
    """`logits` float32 [B, T, V]; `hidden` {layer: [B, T, D]} for the requested layers
    (-1 = embeddings, l = output of block l, before the final norm); `cache` the updated
    KV caches {segment: {"k", "v"}} when a cache was passed, else None."""

    logits: jax.Array | None
    hidden: dict[int, jax.Array]
    cache: Cache | None
    # with `targets_BxT` and cfg.logits_chunk > 0: logits is None and these are float32
    # [B, T]: logsumexp of each position's logits and the target's logit
    lse: jax.Array | None = None
    target_logit: jax.Array | None = None
    # the features' auxiliary loss, float32 [] (0 without one), to be added to the training
    # loss, and their metrics {name: Metric} (block.feature_outputs; v41jax.model.metric)
    aux_loss: jax.Array | float = 0.0
    metrics: Mapping[str, Metric] = {}


def check_cache(cfg: ModelConfig, cache: Any) -> None:
    """ValueError unless `cache` has `cfg`'s segment layout (`generate.init_cache`)."""
    segs = layer_segments(cfg)
    want = {s.name: (s.stop - s.start) if s.scanned else None for s in segs}
    if not isinstance(cache, Mapping) or set(cache) != set(want):
        got = sorted(cache) if isinstance(cache, Mapping) else type(cache).__name__
        raise ValueError(
            f"cache must be a dict keyed by the model's segments {sorted(want)} (build it with "
            f"generate.init_cache(cfg, batch)); got {got}"
        )
    for name, length in want.items():
        k = cache[name]["k"]
        if k.ndim != (5 if length else 4) or (length and k.shape[0] != length):
            raise ValueError(
                f"cache[{name!r}]['k'] has shape {tuple(k.shape)}; expected "
                f"{f'[{length}, B, S, G, K]' if length else '[B, S, G, K]'}"
            )


def check_packed(cfg: ModelConfig, tokens: jax.Array, cache: Any, packed: PackedRows) -> None:
    """ValueError unless packed rows can run: a cache, tokens [1, N] matching `packed`, and
    no feature that mixes tokens along the time axis or across the batch (Engram's short
    conv, capacity-limited MoE)."""
    if cache is None:
        raise ValueError("packed rows need a KV cache (they index its rows)")
    check_cache(cfg, cache)
    n = packed.row_N.shape[0]
    if tokens.shape != (1, n):
        raise ValueError(f"packed tokens must be [1, N={n}], got shape {tuple(tokens.shape)}")
    if cfg.engram.enabled and cfg.engram.use_short_conv:
        raise ValueError("packed rows: Engram's short conv mixes neighbouring tokens (off)")
    if cfg.moe.num_experts > 0 and cfg.moe.capacity_factor > 0:
        raise ValueError(
            f"packed rows need dropless MoE: moe.capacity_factor={cfg.moe.capacity_factor} "
            "must be 0 (an expert's capacity would depend on the other rows' tokens)"
        )


def _run_segment(cfg, stream: ResidualStream, seg: Segment, x, inputs, cache, taps):
    """Segment `seg` on the stream's state x; returns (x, new cache or None, {layer: hidden},
    [LayerStats of each of its layers, in order])."""
    if not seg.scanned:
        block = remat_block(Block, cfg.remat_policy, scanned=False)
        x, new_cache, stats = block(cfg, seg.start, seg.ffn_kind, name=seg.name)(x, inputs, cache)
        hidden = {seg.start: stream.hidden(x)} if seg.start in taps else {}
        return x, new_cache, hidden, [stats]
    tapped = [i for i in range(seg.start, seg.stop) if i in taps]
    scan = nn.scan(
        remat_block(ScanBlock, cfg.remat_policy, scanned=True),
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        length=seg.stop - seg.start,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    body = scan(cfg, seg.start, seg.ffn_kind, tap=bool(tapped), name=seg.name)
    (x, new_cache), (ys, stacked) = body((x, cache), jnp.arange(seg.stop - seg.start), inputs)
    stats = [jax.tree.map(lambda a, j=j: a[j], stacked) for j in range(seg.stop - seg.start)]
    return x, new_cache, {i: ys[i - seg.start] for i in tapped}, stats


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
        cache: Cache | None = None,
        cache_index: jax.Array | None = None,
        extras: Mapping[str, jax.Array] | None = None,
        targets_BxT: jax.Array | None = None,
        packed: PackedRows | None = None,
    ) -> ModelOutput:
        """Forward pass over int tokens [B, T].

        positions_BxT: RoPE positions; default `arange(T)` (plus `cache_index` with a cache).
            Causality follows token order (cache slots with a cache), never these values,
            so positions that restart per packed document are fine.
        segment_ids_BxT: packed-document ids; attention stays within a segment when
            `cfg.segment_mask` (not allowed together with a cache).
        hidden_layers: layers whose outputs go into `ModelOutput.hidden` (-1 = embeddings).
        cache, cache_index: KV caches {segment: {"k", "v"}} (see `generate.init_cache`)
            and int32 [B] first write slots (default 0). Queries then sit at slots
            `cache_index + t`.
        extras: per-token side inputs for later modules, passed to every block.
        targets_BxT: with cfg.logits_chunk > 0, the head runs over chunks of that many
            positions and returns only `lse` and `target_logit`
            (`v41jax.model.head.chunked_head_stats`).
        packed: with a cache, tokens [1, N] are the packed tokens of the cache's rows
            (`v41jax.model.attention.pack_rows`): token n is row_N[n]'s, at slot slot_N[n]
            (its default position); outputs are [1, N, ...] likewise. cache_index is unused.
        """
        c = self.cfg
        dtype, param_dtype = layer_dtypes(c)
        b, t = tokens_BxT.shape
        bad = [i for i in hidden_layers if not -1 <= i < c.num_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range [-1, {c.num_layers - 1}]")

        arange_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if packed is not None:
            check_packed(c, tokens_BxT, cache, packed)
            if positions_BxT is None:
                positions_BxT = packed.slot_N[None]
            layout = packed.layout(next(iter(cache.values()))["k"].shape[-3])
        elif cache is None:
            if positions_BxT is None:
                positions_BxT = arange_BxT
            use_segments = c.segment_mask and segment_ids_BxT is not None
            seg = segment_ids_BxT if use_segments else None
            layout = AttentionLayout(arange_BxT, arange_BxT, seg, seg)
        else:
            check_cache(c, cache)
            if segment_ids_BxT is not None:
                raise ValueError("segment_ids are not supported with a KV cache")
            if cache_index is None:
                cache_index = jnp.zeros((b,), jnp.int32)
            cache_index = jnp.asarray(cache_index, jnp.int32)
            q_slots_BxT = cache_index[:, None] + arange_BxT
            if positions_BxT is None:
                positions_BxT = q_slots_BxT
            s = next(iter(cache.values()))["k"].shape[-3]
            kv_slots_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            layout = AttentionLayout(q_slots_BxT, kv_slots_BxS)

        extras = dict(extras or {})
        if c.engram.enabled and not self.is_initializing():
            extras = _read_host_tables(c, self.variables.get("params", {}), extras)
        inputs = BlockInputs(
            positions_BxT=positions_BxT,
            layout=layout,
            segment_ids_BxT=segment_ids_BxT,
            cache_index_B=cache_index,
            extras=extras,
            packed=packed,
        )
        embed = Embed(
            c.vocab_size,
            c.d_model,
            init_std=c.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            name="embed",
        )
        stream = residual_stream(c)
        x_BxTxD = nn.with_logical_constraint(embed(tokens_BxT), RESIDUAL_AXES)
        hidden = {-1: x_BxTxD} if -1 in hidden_layers else {}
        x = stream.expand(x_BxTxD)

        new_caches, stats = {}, []
        for seg in layer_segments(c):
            seg_cache = None if cache is None else cache[seg.name]
            x, new_caches[seg.name], taps, seg_stats = _run_segment(
                c, stream, seg, x, inputs, seg_cache, hidden_layers
            )
            hidden.update(taps)
            stats.extend(seg_stats)
        aux_loss, metrics = feature_outputs(c, stats)

        # the head's params ("final_norm", "head") sit beside "embed", in this module's scope
        head = Head(c, folded_norm=stream.folds_norms, name="lm_head")
        nn.share_scope(self, head)
        h_BxTxD = stream.read_out(x, head.final_norm)
        out = head(h_BxTxD, embed.embedding if c.tie_embeddings else None, targets_BxT)
        return ModelOutput(
            out.logits,
            hidden,
            new_caches if cache is not None else None,
            out.lse,
            out.target_logit,
            aux_loss,
            metrics,
        )


# ----------------------------------------------------------------------------- helpers


def _read_host_tables(cfg: ModelConfig, params, extras: dict) -> dict:
    """Extras with the rows of every Engram table kept on the host (`HostRows` in params)
    read up front, in one host callback before block 0: the read depends on the ids alone,
    so it can run while the blocks before the first Engram layer compute. Each such layer's
    ids [B, T, H] become slots arange(B T H) into its rows [B T H, C] (`engram_rows_key`)."""
    refs = {}
    for layer in cfg.engram.layer_ids:
        table = params.get(f"block_{layer}", {}).get("engram", {}).get("table")
        if isinstance(table, HostRows) and engram_ids_key(layer) in extras:
            refs[layer] = table
    if not refs or any(engram_rows_key(layer) in extras for layer in refs):
        return extras
    ids = {layer: extras[engram_ids_key(layer)] for layer in refs}
    flat = {layer: flat_row_ids(cfg.engram, layer, i) for layer, i in ids.items()}
    out = dict(extras)
    for layer, rows_NxC in read_host_rows(refs, flat).items():
        shape = ids[layer].shape
        out[engram_ids_key(layer)] = jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)
        out[engram_rows_key(layer)] = rows_NxC
    return out


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Initial params of `Transformer(cfg)` (the tree under "params"), each leaf boxed as
    `nn.LogicallyPartitioned`. Jitted and cached per config; for abstract shapes use
    `jax.eval_shape(functools.partial(init_params, cfg), rng)`."""
    return _init_params_jit(cfg, rng)


def init_inputs(cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(tokens int32 [1, 1], extras) for `Transformer(cfg).init` to trace: the params depend
    on the config and the RNG only. Engram layers need hash ids to trace; id 0 is a valid
    row of every head's table."""
    extras = {
        engram_ids_key(layer): jnp.zeros((1, 1, cfg.engram.num_heads_total), jnp.int32)
        for layer in (cfg.engram.layer_ids if cfg.engram.enabled else ())
    }
    return jnp.zeros((1, 1), jnp.int32), extras


@functools.partial(jax.jit, static_argnames=("cfg",))
def _init_params_jit(cfg: ModelConfig, rng: jax.Array) -> Any:
    tokens, extras = init_inputs(cfg)
    return Transformer(cfg).init(rng, tokens, extras=extras)["params"]


def count_params(params: Any) -> int:
    """Number of scalars in a (boxed or plain) param tree."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params)))
