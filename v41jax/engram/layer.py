"""Engram layer: a gated, hashed n-gram memory read into the residual stream (arXiv 2601.07372).

Shapes: B batch, T time, M residual branches, D model width, H = (N-1) * n_head_per_ngram
hash heads (order-major), C = head_dim, E = H * C, R = table rows. Per position t:

    e_t   = concat_h table[offset_h + id_{t,h}]                 E = (N-1) * n_embed_per_ngram
    k_m   = RMSNorm_km(e_t W_K[m] + b_K[m])      q_m = RMSNorm_qm(h_{t,m})
    s_m   = <k_m, q_m> / sqrt(D);   s_m <- sign(s_m) sqrt(max(|s_m|, 1e-6))
    v_m   = sigmoid(s_m) * (e_t W_V + b_V)
    v_m  <- v_m + SiLU(conv(RMSNorm_cm(v_m)))                    only if cfg.use_short_conv

and the backbone adds the delta: `h <- h + Engram(h, ids)`. With M residual branches (mHC),
the table and W_V are shared and each branch m has its own W_K[m], b_K[m] and norms; the M key
projections are one [E] x [E, M, D] matmul. M = 1 with h [B, T, D] is the plain model.

The pure functions below take a params dict (the names of `Engram`'s params) so raw JAX code
can use them; `Engram` is the Linen shell that owns the params and their logical axis names.

FP8 tables: storage is float8_e4m3fn with a per-row float32 scale, dequantised on gather
(params `table` fp8 [R, C] + `table_scale` [R]). Training keeps a float32 master table when
cfg.table_dtype == "float8_e4m3fn" and fake-quantises the gathered rows (per row, straight-
through gradient); quantisation is per row so it commutes with the gather, and the forward
equals a gather from the exported table (`export_fp8_table`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax import sharding
from v41jax.engram import fp8
from v41jax.engram.config import EngramConfig
from v41jax.engram.host_rows import HostRows
from v41jax.engram.primes import head_offsets, stored_table_rows, table_rows
from v41jax.engram.sharded import ENGRAM_ROW_AXIS, sharded_lookup
from v41jax.kernels.engram_lookup.api import engram_lookup
from v41jax.ops import rms_norm_f32

Dtype = Any
Params = dict[str, jax.Array]
# (table [R, C], flat row ids int32 [B, T, H], row_scale [R] | None) -> e float32 [B, T, E]
LookupFn = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]

_GATE_FLOOR = 1e-6  # |s| floor inside the signed sqrt (the paper's): keeps its grad finite

# ----------------------------------------------------------------------------- pure cores


def engram_gate_value(
    params: Params, h_BxTxMxD: jax.Array, e_BxTxE: jax.Array, *, eps: float = 1e-6
) -> jax.Array:
    """Gated value of every branch m: `v_m = sigmoid(ssqrt(<k_m, q_m> / sqrt(D))) (e W_V + b_V)`.

    k_m = RMSNorm(e W_K[m] + b_K[m]), q_m = RMSNorm(h_m), ssqrt(s) = sign(s) sqrt(max(|s|, 1e-6)).

    params: `w_k` [E, M, D], `b_k` [M, D], `key_norm` [M, D], `query_norm` [M, D],
    `w_v` [E, D], `b_v` [D]. The matmuls run in e's dtype (weights are cast to it) with
    float32 accumulation; norms, the gate and the product are float32. Returns
    [B, T, M, D] in h's dtype.
    """
    cdt = e_BxTxE.dtype
    d = h_BxTxMxD.shape[-1]
    # One matmul for all M keys: [B, T, E] x [E, M, D] -> [B, T, M, D].
    k_BxTxMxD = jnp.einsum(
        "bte,emd->btmd", e_BxTxE, params["w_k"].astype(cdt), preferred_element_type=jnp.float32
    ) + params["b_k"].astype(jnp.float32)
    k_BxTxMxD = rms_norm_f32(k_BxTxMxD, params["key_norm"], eps)
    q_BxTxMxD = rms_norm_f32(h_BxTxMxD, params["query_norm"], eps)
    s_BxTxM = jnp.sum(k_BxTxMxD * q_BxTxMxD, axis=-1) / math.sqrt(d)
    s_BxTxM = jnp.sign(s_BxTxM) * jnp.sqrt(jnp.maximum(jnp.abs(s_BxTxM), _GATE_FLOOR))
    alpha_BxTxMx1 = jax.nn.sigmoid(s_BxTxM)[..., None]
    value_BxTxD = jnp.einsum(
        "bte,ed->btd", e_BxTxE, params["w_v"].astype(cdt), preferred_element_type=jnp.float32
    ) + params["b_v"].astype(jnp.float32)
    return (alpha_BxTxMx1 * value_BxTxD[:, :, None, :]).astype(h_BxTxMxD.dtype)


def short_conv(
    params: Params, v_BxTxMxD: jax.Array, kernel_size: int, dilation: int, eps: float = 1e-5
) -> jax.Array:
    """`v + SiLU(conv(RMSNorm_m(v)))`: the paper's depthwise causal conv over time.

    params: `conv_norm` [M, D] (per-branch RMSNorm scales), `conv_kernel` [kernel_size, M, D].
    Tap j multiplies position `t - (kernel_size - 1 - j) * dilation` (torch Conv1d's layout
    with left padding, so the last tap is the current position); positions before 0 are zero,
    so output t depends only on inputs <= t. A zero kernel makes this the identity. Computed in
    float32, returned in v's dtype.
    """
    kernel_KxMxD = params["conv_kernel"].astype(jnp.float32)
    if kernel_KxMxD.shape[0] != kernel_size:
        raise ValueError(
            f"short_conv: conv_kernel has {kernel_KxMxD.shape[0]} taps, kernel_size={kernel_size}"
        )
    x_BxTxMxD = rms_norm_f32(v_BxTxMxD, params["conv_norm"], eps)
    t = x_BxTxMxD.shape[1]
    pad = (kernel_size - 1) * dilation
    x_pad = jnp.pad(x_BxTxMxD, ((0, 0), (pad, 0), (0, 0), (0, 0)))
    # kernel_size is small (4): a sum of shifted slices fuses into one elementwise pass.
    y_BxTxMxD = sum(
        kernel_KxMxD[j] * x_pad[:, j * dilation : j * dilation + t] for j in range(kernel_size)
    )
    return (v_BxTxMxD.astype(jnp.float32) + jax.nn.silu(y_BxTxMxD)).astype(v_BxTxMxD.dtype)


def flat_row_ids(cfg: EngramConfig, layer_id: int, hash_ids_BxTxH: jax.Array) -> jax.Array:
    """Per-head local ids -> rows of the layer's flat table: `id + head_offsets` (int32)."""
    rows = table_rows(cfg, layer_id)
    if rows >= 2**31:  # int32 gather indices; a table this size needs sharded lookups anyway
        raise ValueError(f"layer {layer_id}: {rows} table rows do not fit int32 row ids")
    offsets_H = jnp.asarray(head_offsets(cfg, layer_id), dtype=jnp.int32)
    return hash_ids_BxTxH.astype(jnp.int32) + offsets_H


def _check_inputs(
    params: Params, h: jax.Array, hash_ids: jax.Array, cfg, layer_id, gathered: bool = False
) -> None:
    if layer_id not in cfg.layer_ids:
        raise ValueError(
            f"Engram: layer_id={layer_id!r} is not in EngramConfig.layer_ids={cfg.layer_ids}"
        )
    if h.ndim not in (3, 4):
        raise ValueError(
            f"Engram: hidden states must be [B, T, D] or [B, T, M, D]; got shape {h.shape}"
        )
    heads = cfg.num_heads_total
    if hash_ids.shape != (*h.shape[:2], heads):
        raise ValueError(
            f"Engram: hash ids must be [B, T, H] = {(*h.shape[:2], heads)} (H = (max_ngram_size"
            f" - 1) * n_head_per_ngram); got shape {hash_ids.shape}"
        )
    if not jnp.issubdtype(hash_ids.dtype, jnp.integer):
        raise ValueError(f"Engram: hash ids must be integers; got {hash_ids.dtype}")
    rows, table = stored_table_rows(cfg, layer_id), params["table"]
    if not gathered and table.shape != (rows, cfg.head_dim):
        raise ValueError(
            f"Engram: table shape {table.shape} != ({rows}, {cfg.head_dim}) (layer {layer_id}'s "
            "sum of primes rounded up to table_row_align, head_dim): params built for another "
            "EngramConfig?"
        )
    m = 1 if h.ndim == 3 else h.shape[2]
    if params["w_k"].shape[1:] != (m, h.shape[-1]):
        raise ValueError(
            f"Engram: w_k [E, M, D] has shape {params['w_k'].shape}; hidden states {h.shape} "
            f"need M={m}, D={h.shape[-1]}"
        )


def gather_memory(
    params: Params,
    cfg: EngramConfig,
    flat_ids_BxTxH: jax.Array,
    lookup: LookupFn,
) -> jax.Array:
    """e = concat of the H addressed rows, float32 [B, T, E].

    An fp8 `table` is dequantised with `table_scale` on gather; an fp32 master table with
    cfg.table_dtype == "float8_e4m3fn" has its gathered rows fake-quantised per row. A
    `HostRows` table is read on the host (`HostRows.lookup`), never copied to the device.
    """
    table = params["table"]
    if isinstance(table, HostRows):  # read on the host by a callback (decoding, eval)
        e_BxTxE = table.lookup(flat_ids_BxTxH)
    elif table.dtype == jnp.float8_e4m3fn:
        if "table_scale" not in params:
            raise ValueError("Engram: an float8_e4m3fn table needs its per-row `table_scale` [R]")
        return lookup(table, flat_ids_BxTxH, params["table_scale"])
    else:
        e_BxTxE = lookup(table, flat_ids_BxTxH, None)
    if cfg.table_dtype == "float8_e4m3fn":
        b, t, h = flat_ids_BxTxH.shape
        rows_BxTxHxC = fp8.fake_quantize_rows(e_BxTxE.reshape(b, t, h, cfg.head_dim))
        e_BxTxE = rows_BxTxHxC.reshape(b, t, h * cfg.head_dim)
    return e_BxTxE


def default_lookup(batch_size: int, lookup_impl: str = "auto") -> LookupFn:
    """The lookup for the current context: the row-sharded all-to-all lookup when a mesh is
    active (`jax.set_mesh`) and splits the tables' rows (`engram_rows` in the sharding rules)
    and the batch divides over its batch axes; else the single-device `engram_lookup`."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        row_axes = tuple(a for a in sharding.mesh_axes_of(ENGRAM_ROW_AXIS) if a in mesh.shape)
        batch_axes = tuple(a for a in sharding.BATCH_MESH_AXES if a in mesh.shape)
        row_shards = math.prod(mesh.shape[a] for a in row_axes)
        if row_shards > 1 and batch_size % sharding.batch_shards(mesh) == 0:
            return lambda table, ids, scale: sharded_lookup(
                table, ids, mesh, row_axes=row_axes, batch_axes=batch_axes, row_scale=scale
            )
    return functools.partial(engram_lookup, impl=lookup_impl)


def engram_forward(
    params: Params,
    h: jax.Array,
    hash_ids_BxTxH: jax.Array,
    cfg: EngramConfig,
    layer_id: int,
    *,
    lookup: LookupFn | None = None,
    lookup_impl: str = "auto",
    dtype: Dtype | None = None,
    eps: float = 1e-6,
    conv_eps: float = 1e-5,
    rows_UxC: jax.Array | None = None,
) -> jax.Array:
    """The Engram delta v for hidden states h [B, T, D] or [B, T, M, D] (same shape out).

    rows_UxC: rows already read from the table (row-sparse training, host tables): then
    `hash_ids_BxTxH` are slots into them, e = concat_h rows[slots[..., h]], and params need
    no `table` (the gradient of e reaches only these U rows, `v41jax.engram.table_optim`).
    Or [B, T, H*C]: every position's rows, e itself (row-sharded sparse training, where the
    rows arrive by all-to-all, `v41jax.engram.sharded_update`); the ids are then unused.

    hash_ids_BxTxH: local per-head ids in [0, prime_h) from `ngram_hash_ids`.
    lookup: `(table, flat_ids, row_scale) -> e f32 [B, T, E]`; default `default_lookup`
        (row-sharded under an active mesh, else `engram_lookup` with `lookup_impl`).
    dtype: compute dtype of the projections (default h's dtype); norms and gate are float32.
    Params as in `Engram` (conv params only if cfg.use_short_conv); `table` may have zero
    padding rows past the prime sum (never addressed), e.g. from `sharded.pad_table`. Raises
    ValueError on a layer_id without Engram, a bad h rank, or hash ids that are not [B, T, H].
    """
    if rows_UxC is not None:
        per_position = (*hash_ids_BxTxH.shape[:2], hash_ids_BxTxH.shape[-1] * cfg.head_dim)
        if rows_UxC.ndim == 3 and rows_UxC.shape == per_position:
            lookup = lambda rows, ids, scale: rows  # noqa: E731  (e was read already)
        elif rows_UxC.ndim != 2 or rows_UxC.shape[1] != cfg.head_dim:
            raise ValueError(
                f"Engram: gathered rows must be [U, head_dim={cfg.head_dim}] or [B, T, H*C] ="
                f" {per_position}; got {rows_UxC.shape}"
            )
        params = {**params, "table": rows_UxC}
        lookup = lookup or functools.partial(engram_lookup, impl="reference")
    _check_inputs(params, h, hash_ids_BxTxH, cfg, layer_id, gathered=rows_UxC is not None)
    dtype = h.dtype if dtype is None else dtype
    if lookup is None:
        lookup = default_lookup(hash_ids_BxTxH.shape[0], lookup_impl)
    if rows_UxC is None:
        flat_ids_BxTxH = flat_row_ids(cfg, layer_id, hash_ids_BxTxH)
    else:
        flat_ids_BxTxH = hash_ids_BxTxH.astype(jnp.int32)
    e_BxTxE = gather_memory(params, cfg, flat_ids_BxTxH, lookup).astype(dtype)
    h_BxTxMxD = (h[:, :, None, :] if h.ndim == 3 else h).astype(dtype)
    v_BxTxMxD = engram_gate_value(params, h_BxTxMxD, e_BxTxE, eps=eps)
    if cfg.use_short_conv:
        v_BxTxMxD = short_conv(params, v_BxTxMxD, cfg.kernel_size, cfg.max_ngram_size, conv_eps)
    return v_BxTxMxD[:, :, 0, :] if h.ndim == 3 else v_BxTxMxD


def export_fp8_table(params: Params) -> Params:
    """Params with the master `table` replaced by fp8 rows + per-row `table_scale` (inference)."""
    q_RxC, scale_R = fp8.quantize_rows(params["table"])
    return {**params, "table": q_RxC, "table_scale": scale_R}


# ----------------------------------------------------------------------------- Linen shell


def table_storage_dtype(cfg: EngramConfig) -> Dtype:
    """Param dtype of the table: bfloat16 if asked, else float32 (also the fp8 master)."""
    return jnp.bfloat16 if cfg.table_dtype == "bfloat16" else jnp.float32


def _fan_in_normal(fan_in: int) -> Callable:
    # N(0, 1/fan_in): e W keeps e's per-entry scale whatever E is.
    return nn.initializers.normal(1.0 / math.sqrt(fan_in))


class Engram(nn.Module):
    """Linen shell over `engram_forward`; returns the delta v (caller does `h + v`).

    Params (logical axes):
      table [R, C]        (engram_rows, engram_head_dim)   R = sum of the layer's primes
      w_v [E, D]          (engram_embed, embed);   b_v [D] (embed,)
      w_k [E, M, D]       (engram_embed, engram_branch, embed);   b_k [M, D]
      key_norm, query_norm [M, D]   (engram_branch, norm)
      conv_norm [M, D], conv_kernel [kernel_size, M, D] (engram_taps, engram_branch, norm)
    Init: table ~ N(0, init_std^2), the scale of the token embedding, so with fan-in W_V
    (N(0, 1/E)) the value e W_V enters the residual stream at the token embedding's scale
    for any E; W_K fan-in too (keys are RMSNormed, so only its direction matters); biases 0,
    norm scales 1, conv kernel 0 (the paper's zero init: identity at start).
    Serving FP8: apply with `export_fp8_table(params)` (fp8 `table` + `table_scale` [R]).
    """

    cfg: EngramConfig
    layer_id: int
    hidden_size: int
    num_branches: int = 1
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    lookup_impl: str = "auto"
    init_std: float = 0.02

    @nn.compact
    def __call__(
        self, h: jax.Array, hash_ids_BxTxH: jax.Array, rows_UxC: jax.Array | None = None
    ) -> jax.Array:
        """h [B, T, D] (needs num_branches == 1) or [B, T, M, D]; ids int [B, T, H].

        rows_UxC: the rows read from the table outside the module (row-sparse training,
        host tables): [U, C] with ids as slots into them, or [B, T, H*C] per position; the
        module then declares no `table`."""
        cfg, d, m = self.cfg, self.hidden_size, self.num_branches
        if self.layer_id not in cfg.layer_ids:
            raise ValueError(f"Engram: layer_id={self.layer_id} not in layer_ids={cfg.layer_ids}")
        want = (d,) if m == 1 and h.ndim == 3 else (m, d)
        if h.ndim not in (3, 4) or h.shape[2:] != want:
            raise ValueError(
                f"Engram(hidden_size={d}, num_branches={m}): hidden states must be [B, T, D]"
                f" (M=1) or [B, T, {m}, {d}]; got shape {h.shape}"
            )
        e, pdt = cfg.embed_dim, self.param_dtype

        def param(name, init, names, shape, dtype=pdt):
            return self.param(name, nn.with_logical_partitioning(init, names), shape, dtype)

        zeros, ones = nn.initializers.zeros, nn.initializers.ones
        rows = stored_table_rows(cfg, self.layer_id)
        params = {
            "w_v": param("w_v", _fan_in_normal(e), ("engram_embed", "embed"), (e, d)),
            "b_v": param("b_v", zeros, ("embed",), (d,)),
            "w_k": param(
                "w_k", _fan_in_normal(e), ("engram_embed", "engram_branch", "embed"), (e, m, d)
            ),
            "b_k": param("b_k", zeros, ("engram_branch", "embed"), (m, d)),
            "key_norm": param("key_norm", ones, ("engram_branch", "norm"), (m, d)),
            "query_norm": param("query_norm", ones, ("engram_branch", "norm"), (m, d)),
        }
        given = self.get_variable("params", "table") if rows_UxC is None else None
        if isinstance(given, HostRows):  # kept on the host: read by a callback, not a param
            params["table"] = given
        elif rows_UxC is None:
            params["table"] = param(
                "table",
                nn.initializers.normal(self.init_std),
                ("engram_rows", "engram_head_dim"),
                (rows, cfg.head_dim),
                table_storage_dtype(cfg),
            )
        if self.has_variable("params", "table_scale"):  # served from `export_fp8_table`
            params["table_scale"] = self.get_variable("params", "table_scale")
        if cfg.use_short_conv:
            params["conv_norm"] = param("conv_norm", ones, ("engram_branch", "norm"), (m, d))
            params["conv_kernel"] = param(
                "conv_kernel",
                zeros,
                ("engram_taps", "engram_branch", "norm"),
                (cfg.kernel_size, m, d),
            )
        return engram_forward(
            params,
            h,
            hash_ids_BxTxH,
            cfg,
            self.layer_id,
            lookup_impl=self.lookup_impl,
            dtype=self.dtype,
            rows_UxC=rows_UxC,
        )


__all__ = [
    "Engram",
    "engram_forward",
    "engram_gate_value",
    "export_fp8_table",
    "flat_row_ids",
    "gather_memory",
    "short_conv",
    "table_storage_dtype",
]
