"""Analytic communication cost of the row-sharded Engram lookup, and the method choice.

Bytes per local token per device, H heads, E = head dim, b bytes per table element, S row
shards, capacity factor cf (see `v41jax.engram.sharded` for the two exchanges):
    all_to_all ~ cf * H * (S - 1) / S * (4 + E * b)   (ids out, rows back: ~ the output once)
    psum       ~ (S - 1) * H * (4 + 4 * E)            (f32 partial rows reduce-scattered)
"""

from __future__ import annotations

import math

from jax.sharding import Mesh

METHODS = ("auto", "psum", "all_to_all")
DEFAULT_CAPACITY_FACTOR = 1.25


def axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def lookup_bytes_per_token(
    method: str,
    num_devices: int,
    num_heads: int,
    head_dim: int,
    bytes_per_elem: int,
    *,
    num_batch_shards: int | None = None,
    num_row_shards: int | None = None,
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    id_bytes: int = 4,
    out_bytes: int = 4,
    scale_bytes: int = 0,
) -> dict[str, float]:
    """Analytic bytes one device sends (= receives) per local token, forward and backward.

    D devices, G = batch shards (default D), S = row shards (default D), t = D / G replicas
    holding the same ids, H heads, E = head_dim, b = table bytes/elem; row axes are assumed
    to contain the batch axes (the default). Ring collectives: all-gather / reduce-scatter
    over k devices move (k-1)/k of the full buffer, all-reduce twice that.

    all_to_all: each device routes H/t ids through a buffer padded to cf*H/t slots,
        ids = cf*H/t*(S-1)/S*4, rows = cf*H/t*(S-1)/S*(E*b + scale),
        replica_gather = (t-1)/t*H*(E*b + scale) (rows over the replicas, still narrow);
        backward: ids again + f32 cotangent rows, no replica traffic.
    psum: ids = (G-1)*H*4 (all-gather of the group's ids),
        rows = (G-1)*H*E*4 (reduce-scatter of f32 partial rows) + 2(k-1)/k*H*E*4 (all-reduce
        over the k = S/G row shards sharing a batch shard); backward: all-gather of the
        cotangent, (G-1)*H*E*4.
    """
    if method not in METHODS[1:]:
        raise ValueError(f"method={method!r} must be one of {METHODS[1:]}")
    d, h, e = num_devices, num_heads, head_dim
    g = d if num_batch_shards is None else num_batch_shards
    s = d if num_row_shards is None else num_row_shards
    if d % g or s % g:
        raise ValueError(f"num_batch_shards={g} must divide num_devices={d} and row shards={s}")
    out = {"output": h * e * out_bytes, "table_rows": h * (e * bytes_per_elem + scale_bytes)}
    if method == "all_to_all":
        t = d // g
        slots = capacity_factor * h / t * (s - 1) / s
        ids, rows = slots * id_bytes, slots * (e * bytes_per_elem + scale_bytes)
        replica = (t - 1) / t * h * (e * bytes_per_elem + scale_bytes)
        backward = slots * (id_bytes + e * 4)
    else:
        k = s // g
        ids = (g - 1) * h * id_bytes
        rows = (g - 1) * h * e * out_bytes + 2 * (k - 1) / k * h * e * out_bytes
        replica = 0.0
        backward = (g - 1) * h * e * 4
    parts = {"ids": ids, "rows": rows, "replica_gather": replica}
    return out | parts | {"total": ids + rows + replica, "backward": backward}


def choose_method(
    mesh: Mesh, row_axes, batch_axes, num_heads: int, head_dim: int, bytes_per_elem: int
) -> str:
    """The method with fewer analytic forward bytes per token (psum when nothing is split)."""
    s, g = axis_size(mesh, row_axes), axis_size(mesh, batch_axes)
    if s == 1:
        return "psum"  # a plain local gather: no exchange needed
    if not set(batch_axes) <= set(row_axes):
        return "all_to_all"  # outside the analytic model; never worse than (S - 1) x output
    kw = dict(num_batch_shards=g, num_row_shards=s)
    args = (mesh.size, num_heads, head_dim, bytes_per_elem)
    cost = {m: lookup_bytes_per_token(m, *args, **kw)["total"] for m in METHODS[1:]}
    return min(cost, key=cost.get)
