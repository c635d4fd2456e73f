"""Row-sharded Engram table lookup over a (data, fsdp, tensor) mesh (Engram, arXiv 2601.07372).

An Engram layer reads `e[b, t] = concat_h table[ids[b, t, h]]` from one flat table
`table [R, E]` (R = sum of the per-head primes, up to billions of rows). The table is split
by rows over `row_axes` (logical axis `engram_rows`; default all devices) and the ids are
split by batch over `batch_axes`. `R` is prime-sized, so the table is zero-padded to `Rp`, a
multiple of the shard count S; padding rows are never addressed because every id is < R.
Shard s owns rows `[s * Rp/S, (s+1) * Rp/S)`, s = linear index over `row_axes`.

Two exact implementations (`method`), per device, for its b*T*H local ids:

* `all_to_all` (default): split the ids over the replica axes (outside `batch_axes`, where
  devices hold the same ids) into shares of m; sort them (owner = id // (Rp/S) is monotone
  in id: one sort groups by owner and puts duplicates side by side); give each distinct id
  a slot `[owner, pos]` in a static `[S, C]` buffer, `C = ceil(cf * m / S)`; all-to-all the
  row numbers to their owners, which gather `[S, C, E]` rows and all-to-all them back;
  all-gather the shares over the replica axes. ~ cf x the table bytes of the output per
  token. An owner asked for more than C distinct ids gets more rounds of the same exchange
  (a loop over the `pmax` of rounds needed): skewed ids cost time, never correctness.
  Backward (custom VJP): the same routing carries cotangent rows to the owners, which
  scatter-add them into their shard: `dtable[r] = sum_{(b,t,h): ids = r} g[b, t, h]`.
* `psum`: all-gather the ids of the row group's batch, gather the locally owned rows
  (others zero), reduce-scatter back to the batch shards: ~ (S - 1) x the f32 output per
  token, and the whole group's output materialised on every device. Kept as a reference.

`lookup_bytes_per_token` gives the analytic bytes of both; `auto` picks the cheaper.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from v41jax import sharding
from v41jax.engram.sharded_cost import (
    DEFAULT_CAPACITY_FACTOR,
    METHODS,
    axis_size,
    choose_method,
)

ENGRAM_ROW_AXIS = "engram_rows"
# Mesh axes are named in v41jax/sharding.py only: the rules table decides where rows live.
DEFAULT_ROW_AXES: tuple[str, ...] = sharding.mesh_axes_of(ENGRAM_ROW_AXIS)
DEFAULT_BATCH_AXES: tuple[str, ...] = sharding.BATCH_MESH_AXES


def padded_rows(num_rows: int, num_shards: int) -> int:
    """`num_rows` rounded up to a multiple of `num_shards`."""
    if num_rows < 1 or num_shards < 1:
        raise ValueError(f"num_rows={num_rows} and num_shards={num_shards} must be >= 1")
    return -(-num_rows // num_shards) * num_shards


def pad_table(table: jax.Array, num_shards: int) -> jax.Array:
    """Append zero rows to `table [R, ...]` (or a per-row scale [R]) up to `padded_rows`.

    Hashed ids are `mix mod p` plus the head's offset, so every id is < R and the padding
    rows are never read; they only make the row split even (and get zero gradient).
    """
    rows = table.shape[0]
    pad = padded_rows(rows, num_shards) - rows
    if pad == 0:
        return table
    return jnp.concatenate([table, jnp.zeros((pad, *table.shape[1:]), table.dtype)], axis=0)


@dataclasses.dataclass(frozen=True)
class RowShardPlan:
    """Static description of one sharded lookup (hashable: a custom_vjp nondiff arg)."""

    mesh: Mesh
    row_axes: tuple[str, ...]
    batch_axes: tuple[str, ...]
    rows_per_shard: int
    capacity_factor: float
    table_dtype: str

    @property
    def num_row_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.row_axes)

    row_spec = property(lambda self: PartitionSpec(self.row_axes, None))
    batch_spec = property(lambda self: PartitionSpec(self.batch_axes))
    # axes where every device holds the same ids (they split the work between them)
    replica_axes = property(lambda self: _axes_outside(self.mesh, self.batch_axes))
    # axes where the table is replicated (its gradient is summed over them)
    table_replica_axes = property(lambda self: _axes_outside(self.mesh, self.row_axes))

    def capacity(self, m: int) -> int:
        return max(1, math.ceil(self.capacity_factor * m / self.num_row_shards))


def _axes_outside(mesh: Mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a not in axes)


def _axis_index(axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def my_share(plan: RowShardPlan, flat: jax.Array, fill) -> jax.Array:
    """This device's 1/t slice of `flat [n, ...]` over the replica axes (padded with fill)."""
    t = axis_size(plan.mesh, plan.replica_axes)
    m = -(-flat.shape[0] // t)
    pad = [(0, m * t - flat.shape[0])] + [(0, 0)] * (flat.ndim - 1)
    flat = jnp.pad(flat, pad, constant_values=fill)
    return jax.lax.dynamic_slice_in_dim(flat, _axis_index(plan.replica_axes) * m, m)


def route_ids(plan: RowShardPlan, ids_m: jax.Array):
    """Slot of every id in the [S, C] exchange buffer; duplicates share one slot.

    Returns perm (sort order), owner, pos (slot index within the owner's bucket, may exceed
    C: round pos // C), local row, and the number of rounds all devices must run.
    Invalid entries (share padding, id == Rp) get owner S and are never sent.
    """
    s_shards, rl = plan.num_row_shards, plan.rows_per_shard
    perm = jnp.argsort(ids_m, stable=True)
    srt = ids_m[perm]
    first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
    uniq = jnp.cumsum(first.astype(jnp.int32)) - 1
    owner = srt // rl
    counts = jax.ops.segment_sum(first.astype(jnp.int32), owner, num_segments=s_shards)
    starts = jnp.cumsum(counts) - counts
    pos = uniq - starts[jnp.minimum(owner, s_shards - 1)]
    cap = plan.capacity(ids_m.shape[0])
    rounds = jax.lax.pmax((jnp.max(counts) + cap - 1) // cap, plan.mesh.axis_names)
    return perm, owner, pos, srt - owner * rl, rounds, cap


def round_slots(owner, pos, k, cap, s_shards):
    """Buffer coordinates of the entries served in round k; others point out of bounds."""
    live = (owner < s_shards) & (pos // cap == k)
    return live, jnp.where(live, owner, s_shards), jnp.where(live, pos - k * cap, 0)


def _narrow_safe(collective, x: jax.Array) -> jax.Array:
    """Run `collective` on x, moving narrow floats as same-width unsigned ints.

    XLA (CPU at least) otherwise hoists the later f32 convert above the collective and moves
    twice (bf16) or four times (fp8) the bytes.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        return jax.lax.bitcast_convert_type(collective(bits), x.dtype)
    return collective(x)


def exchange(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Block j of x [S, ...] goes to row shard j; block j of the result came from shard j."""
    return _narrow_safe(lambda y: jax.lax.all_to_all(y, axes, 0, 0, tiled=True), x)


def _a2a_forward_local(plan: RowShardPlan, table_l, ids_l, scale_l):
    """Per-device forward of the all-to-all lookup: ids_l [b, T, H] -> [b, T, H*E] f32.

    Rows stay in the table's dtype (plus an f32 scale for FP8) until after the last
    collective, so every byte on the wire is a table byte; dequantisation is local.
    """
    b, t, h = ids_l.shape
    rows_pad, e = plan.num_row_shards * plan.rows_per_shard, table_l.shape[1]
    ids_m = my_share(plan, ids_l.reshape(-1), rows_pad)
    perm, owner, pos, lrow, rounds, cap = route_ids(plan, ids_m)
    s_shards, rl, m = plan.num_row_shards, plan.rows_per_shard, ids_m.shape[0]

    def one_round(k, carry):
        live, so, sp = round_slots(owner, pos, k, cap, s_shards)
        req = jnp.full((s_shards, cap), rl, jnp.int32).at[so, sp].set(lrow, mode="drop")
        req = exchange(req, plan.row_axes)  # [S, C] local rows asked of me, rl = empty
        so, new = jnp.minimum(so, s_shards - 1), []
        for src, old in zip(sources, carry, strict=True):
            got = exchange(jnp.take(src, req, axis=0, mode="fill", fill_value=0), plan.row_axes)
            new.append(jnp.where(live.reshape(-1, *[1] * (old.ndim - 1)), got[so, sp], old))
        return tuple(new)

    sources = (table_l,) if scale_l is None else (table_l, scale_l)
    init = tuple(jnp.zeros((m, *x.shape[1:]), x.dtype) for x in sources)
    parts = jax.lax.fori_loop(0, rounds, one_round, init)
    parts = [jnp.zeros_like(x).at[perm].set(x, unique_indices=True) for x in parts]
    # the replicas served disjoint shares of the same ids: reassemble them
    if axis_size(plan.mesh, plan.replica_axes) > 1:
        gather = functools.partial(jax.lax.all_gather, axis_name=plan.replica_axes, tiled=True)
        parts = [_narrow_safe(gather, x) for x in parts]
    out = parts[0].astype(jnp.float32)
    if scale_l is not None:
        out = out * parts[1].astype(jnp.float32)[:, None]
    return out[: b * t * h].reshape(b, t, h * e)


def _a2a_backward_local(plan: RowShardPlan, ids_l, g_l):
    """Per-device backward: scatter-add the cotangent rows into the owning shard [Rp/S, E]."""
    h = ids_l.shape[-1]
    rows_pad, e = plan.num_row_shards * plan.rows_per_shard, g_l.shape[-1] // h
    ids_m = my_share(plan, ids_l.reshape(-1), rows_pad)
    g_m = my_share(plan, g_l.reshape(-1, e).astype(jnp.float32), 0)
    perm, owner, pos, lrow, rounds, cap = route_ids(plan, ids_m)
    g_srt, s_shards, rl = g_m[perm], plan.num_row_shards, plan.rows_per_shard

    def one_round(k, grad):
        live, so, sp = round_slots(owner, pos, k, cap, s_shards)
        req = jnp.full((s_shards, cap), rl, jnp.int32).at[so, sp].set(lrow, mode="drop")
        # duplicates of one id share a slot: their cotangents add up before they travel
        cot = jnp.zeros((s_shards, cap, e), jnp.float32).at[so, sp].add(g_srt, mode="drop")
        req, cot = exchange(req, plan.row_axes), exchange(cot, plan.row_axes)
        return grad.at[req.reshape(-1)].add(cot.reshape(-1, e), mode="drop")

    grad = jax.lax.fori_loop(0, rounds, one_round, jnp.zeros((rl, e), jnp.float32))
    # each replica of the table saw only its part of the batch
    if axis_size(plan.mesh, plan.table_replica_axes) > 1:
        grad = jax.lax.psum(grad, plan.table_replica_axes)
    return grad.astype(plan.table_dtype)


def a2a_forward(plan: RowShardPlan, table, ids, scale):
    fn = functools.partial(_a2a_forward_local, plan)
    scale_spec = None if scale is None else PartitionSpec(plan.row_axes)
    in_specs = (plan.row_spec, plan.batch_spec, scale_spec)
    # check_vma off: the outputs are replica-invariant by construction (all_gather) and the
    # VJP is written by hand, so the shard_map is never transposed.
    smap = jax.shard_map(
        fn, mesh=plan.mesh, in_specs=in_specs, out_specs=plan.batch_spec, check_vma=False
    )
    return smap(table, ids, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _a2a_lookup(plan: RowShardPlan, table, ids):
    return a2a_forward(plan, table, ids, None)


def _a2a_lookup_fwd(plan: RowShardPlan, table, ids):
    return a2a_forward(plan, table, ids, None), ids


def _a2a_lookup_bwd(plan: RowShardPlan, ids, g):
    fn = functools.partial(_a2a_backward_local, plan)
    in_specs = (plan.batch_spec, plan.batch_spec)
    smap = jax.shard_map(
        fn, mesh=plan.mesh, in_specs=in_specs, out_specs=plan.row_spec, check_vma=False
    )
    return smap(ids, g), None


_a2a_lookup.defvjp(_a2a_lookup_fwd, _a2a_lookup_bwd)


def _psum_lookup(plan: RowShardPlan, table, ids, scale):
    """Masked local gather + reduce-scatter; differentiated by JAX autodiff (check_vma on)."""
    gather_axes = tuple(a for a in plan.batch_axes if a in plan.row_axes)
    sum_axes = tuple(a for a in plan.row_axes if a not in plan.batch_axes)
    rl = plan.rows_per_shard

    def local(table_l, ids_l, scale_l):
        b, t, h = ids_l.shape
        grp = jax.lax.all_gather(ids_l, gather_axes, tiled=True) if gather_axes else ids_l
        lrow = grp - _axis_index(plan.row_axes) * rl
        mine = (lrow >= 0) & (lrow < rl)
        rows = jnp.take(table_l, jnp.where(mine, lrow, 0), axis=0).astype(jnp.float32)
        if scale_l is not None:
            rows = rows * jnp.take(scale_l, jnp.where(mine, lrow, 0)).astype(jnp.float32)[..., None]
        part = jnp.where(mine[..., None], rows, 0.0).reshape(grp.shape[0], t, -1)
        if gather_axes:
            part = jax.lax.psum_scatter(part, gather_axes, tiled=True)
        return jax.lax.psum(part, sum_axes) if sum_axes else part

    in_specs = (
        plan.row_spec,
        plan.batch_spec,
        None if scale is None else PartitionSpec(plan.row_axes),
    )
    smap = jax.shard_map(local, mesh=plan.mesh, in_specs=in_specs, out_specs=plan.batch_spec)
    return smap(table, ids, scale)


def _check_inputs(table, ids, mesh, row_axes, batch_axes, method, row_scale) -> None:
    for name, axes in (("row_axes", row_axes), ("batch_axes", batch_axes)):
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(f"{name}={axes} must be distinct axes of the mesh {mesh.axis_names}")
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}")
    if table.ndim != 2:
        raise ValueError(f"table shape {table.shape} must be [rows, head_dim]")
    shards = axis_size(mesh, row_axes)
    if table.shape[0] % shards:
        raise ValueError(
            f"table has {table.shape[0]} rows, not a multiple of the {shards} row shards over "
            f"{row_axes}; pad it with pad_table(table, {shards}) "
            f"(-> {padded_rows(table.shape[0], shards)} rows)"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids dtype {ids.dtype} must be an integer type (int32 row ids)")
    if ids.ndim != 3:
        raise ValueError(f"ids shape {ids.shape} must be [B, T, H] (rank 3, got {ids.ndim})")
    bshards = axis_size(mesh, batch_axes)
    if ids.shape[0] % bshards:
        raise ValueError(f"batch B={ids.shape[0]} is not a multiple of {bshards} {batch_axes}")
    if row_scale is not None and row_scale.shape != (table.shape[0],):
        raise ValueError(f"row_scale shape {row_scale.shape} must be ({table.shape[0]},)")
    if isinstance(ids, jax.core.Tracer) or not getattr(ids, "is_fully_addressable", True):
        return  # under jit: ids are clamped instead
    host = np.asarray(ids)  # numpy, so the check is never staged into an enclosing trace
    if host.size:
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= table.shape[0]:
            raise ValueError(f"ids span [{lo}, {hi}], outside the table's [0, {table.shape[0]})")


def sharded_lookup(
    table_RpxE: jax.Array,
    ids_BxTxH: jax.Array,
    mesh: Mesh,
    *,
    row_axes: tuple[str, ...] = DEFAULT_ROW_AXES,
    batch_axes: tuple[str, ...] = DEFAULT_BATCH_AXES,
    method: str = "auto",
    row_scale: jax.Array | None = None,
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> jax.Array:
    """`concat_h table[ids[b, t, h]]` -> [B, T, H*E] float32, table row-sharded over row_axes.

    table_RpxE: [Rp, E], Rp a multiple of the row shards (`pad_table`), sharded
        PartitionSpec(row_axes, None). ids_BxTxH: int [B, T, H] in [0, R), sharded over
        batch_axes (checked when concrete; under jit out-of-range ids are clamped).
    method: "all_to_all" (exchange ids and rows, module docstring), "psum" (masked gather +
        reduce-scatter) or "auto" (fewer bytes per token; all_to_all whenever rows are split).
    row_scale: optional [Rp] per-row dequantisation scale (FP8 tables): out = table[id] *
        scale[id]; the table is then a frozen constant (no gradient).
    capacity_factor: all_to_all slots per owner = ceil(cf * ids / S); overflow costs extra
        exchange rounds, never accuracy.
    Gradients wrt the table equal the unsharded lookup's (padding rows get zero).
    """
    table, ids = table_RpxE, ids_BxTxH
    row_axes, batch_axes = tuple(row_axes), tuple(batch_axes)
    _check_inputs(table, ids, mesh, row_axes, batch_axes, method, row_scale)
    rows_per_shard = table.shape[0] // axis_size(mesh, row_axes)
    cf, dtype = float(capacity_factor), str(table.dtype)
    plan = RowShardPlan(mesh, row_axes, batch_axes, rows_per_shard, cf, dtype)
    if method == "auto":
        sizes = (ids.shape[-1], table.shape[1], table.dtype.itemsize)
        method = choose_method(mesh, row_axes, batch_axes, *sizes)
    ids = jnp.clip(ids.astype(jnp.int32), 0, table.shape[0] - 1)
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(mesh, PartitionSpec(batch_axes)))
    if row_scale is not None:
        table, row_scale = jax.lax.stop_gradient(table), jax.lax.stop_gradient(row_scale)
        if method == "all_to_all":
            return a2a_forward(plan, table, ids, row_scale)
    if method == "psum":
        return _psum_lookup(plan, table, ids, row_scale)
    return _a2a_lookup(plan, table, ids)


def reference_lookup(table_RxE: jax.Array, ids_BxTxH: jax.Array) -> jax.Array:
    """Unsharded `table[ids]` -> [B, T, H*E] float32: the spec the sharded lookup matches."""
    b, t, h = ids_BxTxH.shape
    return table_RxE[ids_BxTxH].astype(jnp.float32).reshape(b, t, h * table_RxE.shape[1])
