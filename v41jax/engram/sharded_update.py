"""Row-sparse training of a row-sharded Engram table: rows and gradients move by all-to-all.

The table `T [Rp, C]` and its row-sparse optimizer state are split by rows over `row_axes`
(shard s owns rows `[s Rp/S, (s+1) Rp/S)`, `v41jax.engram.sharded`), the batch by
`batch_axes`. One training step, per Engram layer, with flat row ids x [B, T, H]:

    e = T[x]                          [B, T, H C]: rows requested of their owners and sent
                                      back by all-to-all (`sharded_rows`, no VJP needed)
    g_e = d loss / d e                [B, T, H C], split like the batch
    (u_s, g_s) = owner_gradients(x, g_e)
        each device sums the cotangents of its distinct ids, all-to-alls them to the
        owners (the forward's routing), and each owner s sums what all sources sent for
        one row: u_s [K] its distinct local rows (padded with Rp/S), g_s [K, C] with
        g_s[j] = sum_{(b,t,h): x = s Rp/S + u_s[j]} g_e[b, t, h]
    T_s, state_s <- sparse_update(T_s, state_s, u_s, clip g_s)     on the owner, in place

so no device sees another shard's rows, a row's gradient travels once per source that read
it, and every row gets exactly the one update the unsharded sparse step gives it (Adam is
not linear in g: the owner sums every source's and every capacity round's contribution for a
row before it updates it). `sum |g_s|^2` over owners is the squared norm of the dense table
gradient, so the global-norm clip is the single-device one.

Static sizes: a source sends at most m distinct ids (m = its share of the ids), C_x = ceil(cf m
/ S) per owner per round, so at most ceil(m / C_x) rounds; an owner keeps K = rounds_max S C_x
slots. The common one-round step reduces only the first S C_x of them.

Why not `jax.grad` through `sharded_lookup`: its VJP scatter-adds into a dense [Rp/S, C]
gradient per shard (table-sized), which a row-sparse optimizer would then have to scan.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from v41jax.engram import table_optim
from v41jax.engram.sharded import (
    RowShardPlan,
    a2a_forward,
    axis_size,
    exchange,
    my_share,
    round_slots,
    route_ids,
)
from v41jax.engram.sharded_cost import DEFAULT_CAPACITY_FACTOR


def row_shard_plan(
    mesh,
    table_shape: tuple[int, int],
    batch_size: int,
    row_axes: tuple[str, ...],
    batch_axes: tuple[str, ...],
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> RowShardPlan | None:
    """The exchange plan for a [Rp, C] table on `mesh`, or None where this path does not
    apply: fewer than 2 row shards, rows not a multiple of the shards, a batch the batch
    axes do not divide, or a table replicated over some mesh axis (its replicas would each
    need every group's gradients; the GSPMD path handles that layout)."""
    row_axes = tuple(a for a in row_axes if a in mesh.shape)
    batch_axes = tuple(a for a in batch_axes if a in mesh.shape)
    shards = axis_size(mesh, row_axes)
    if shards < 2 or table_shape[0] % shards or batch_size % axis_size(mesh, batch_axes):
        return None
    if any(a not in row_axes and mesh.shape[a] > 1 for a in mesh.axis_names):
        return None
    rows_per_shard, cf = table_shape[0] // shards, float(capacity_factor)
    return RowShardPlan(mesh, row_axes, batch_axes, rows_per_shard, cf, "float32")


def _check(plan: RowShardPlan, ids, name: str, other=None) -> None:
    if ids.ndim != 3 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}: ids must be int [B, T, H]; got {ids.dtype} {ids.shape}")
    if other is not None and (
        other.ndim != 3 or other.shape[:2] != ids.shape[:2] or other.shape[2] % ids.shape[2]
    ):
        raise ValueError(f"{name}: rows {other.shape} must be [B, T, H*C] for ids {ids.shape}")


def sharded_rows(plan: RowShardPlan, table_RpxC: jax.Array, ids_BxTxH: jax.Array) -> jax.Array:
    """`concat_h T[ids[b, t, h]]` -> [B, T, H*C] float32, split like the batch (forward of
    the all-to-all lookup, `v41jax.engram.sharded`); ids must lie in [0, Rp)."""
    _check(plan, ids_BxTxH, "sharded_rows")
    return a2a_forward(plan, table_RpxC, ids_BxTxH.astype(jnp.int32), None)


def _owner_gradients_local(plan: RowShardPlan, ids_l, g_l):
    """Per device: ids_l [b, T, H], g_l [b, T, H*C] -> (rows [K], grads [K, C]) of its shard."""
    h = ids_l.shape[-1]
    e = g_l.shape[-1] // h
    s_shards, rl = plan.num_row_shards, plan.rows_per_shard
    ids_m = my_share(plan, ids_l.reshape(-1), s_shards * rl)
    g_m = my_share(plan, g_l.reshape(-1, e).astype(jnp.float32), 0)
    perm, owner, pos, lrow, rounds, cap = route_ids(plan, ids_m)
    # a source sends at most m = ids_m.size distinct ids to one owner: ceil(m / C_x) rounds
    max_rounds = math.ceil(ids_m.shape[0] / cap)
    g_srt, width = g_m[perm], s_shards * cap

    def one_round(k, bufs):
        rows_buf, grad_buf = bufs
        live, so, sp = round_slots(owner, pos, k, cap, s_shards)
        req = jnp.full((s_shards, cap), rl, jnp.int32).at[so, sp].set(lrow, mode="drop")
        # duplicates of one id share a slot: their cotangents add up before they travel
        cot = jnp.zeros((s_shards, cap, e), jnp.float32).at[so, sp].add(g_srt, mode="drop")
        req, cot = exchange(req, plan.row_axes), exchange(cot, plan.row_axes)
        rows_buf = jax.lax.dynamic_update_slice(rows_buf, req.reshape(1, width), (k, 0))
        grad_buf = jax.lax.dynamic_update_slice(grad_buf, cot.reshape(1, width, e), (k, 0, 0))
        return rows_buf, grad_buf

    init = (
        jnp.full((max_rounds, width), rl, jnp.int32),
        jnp.zeros((max_rounds, width, e), jnp.float32),
    )
    rows_buf, grad_buf = jax.lax.fori_loop(0, rounds, one_round, init)
    total = max_rounds * width

    def reduce(rows_K, grads_KxC):
        # several sources (or rounds) may send one row: one entry per row, their sum
        rows, inv = jnp.unique(rows_K, size=rows_K.shape[0], fill_value=rl, return_inverse=True)
        grads = jax.ops.segment_sum(grads_KxC, inv.reshape(-1), num_segments=rows_K.shape[0])
        pad = total - rows_K.shape[0]
        rows = jnp.pad(rows.astype(jnp.int32), (0, pad), constant_values=rl)
        return rows, jnp.pad(grads, ((0, pad), (0, 0)))

    if max_rounds == 1:
        return reduce(rows_buf[0], grad_buf[0])
    return jax.lax.cond(
        rounds <= 1,
        lambda: reduce(rows_buf[0], grad_buf[0]),
        lambda: reduce(rows_buf.reshape(-1), grad_buf.reshape(-1, e)),
    )


def owner_gradients(plan: RowShardPlan, ids_BxTxH: jax.Array, g_BxTxE: jax.Array):
    """(rows [S K], grads [S K, C]) split over the row axes: block s holds shard s's
    distinct local rows read by the batch (padded with Rp/S) and each one's summed
    cotangent (module doc). ids in [0, Rp); g_BxTxE = d loss / d `sharded_rows(...)`."""
    _check(plan, ids_BxTxH, "owner_gradients", g_BxTxE)
    fn = functools.partial(_owner_gradients_local, plan)
    smap = jax.shard_map(
        fn,
        mesh=plan.mesh,
        in_specs=(plan.batch_spec, plan.batch_spec),
        out_specs=(PartitionSpec(plan.row_axes), plan.row_spec),
        check_vma=False,  # every owner's output is its own by construction
    )
    return smap(ids_BxTxH.astype(jnp.int32), g_BxTxE)


def sharded_sparse_update(
    plan: RowShardPlan,
    kind: str,
    table_RpxC: jax.Array,
    state: dict,
    rows_SK: jax.Array,
    grads_SKxC: jax.Array,
    lr,
    **hyper,
):
    """(table, state) after `table_optim.sparse_update` on every shard with its own rows
    (`owner_gradients`); state arrays [Rp, ...] are split like the table. hyper: b1, b2,
    eps, weight_decay, momentum, step. A rule that balances over rows (sinkhorn_sparse)
    sums over every shard's rows (a psum of scalars and [C] column sums), so the shards
    together take the unsharded step."""
    table_optim.check_kind(kind)
    row, state_specs = plan.row_spec, jax.tree.map(lambda _: plan.row_spec, state)
    step = jnp.asarray(hyper.pop("step", 0), jnp.int32)

    def reduce(x):
        return jax.lax.psum(x, plan.row_axes)

    def local(table_l, state_l, rows_l, grads_l, lr, step):
        return table_optim.sparse_update(
            kind, table_l, state_l, rows_l, grads_l, lr, step=step, reduce=reduce, **hyper
        )

    smap = jax.shard_map(
        local,
        mesh=plan.mesh,
        in_specs=(
            row,
            state_specs,
            PartitionSpec(plan.row_axes),
            row,
            PartitionSpec(),
            PartitionSpec(),
        ),
        out_specs=(row, state_specs),
        check_vma=False,
    )
    return smap(table_RpxC, state, rows_SK, grads_SKxC, jnp.asarray(lr, jnp.float32), step)


__all__ = ["owner_gradients", "row_shard_plan", "sharded_rows", "sharded_sparse_update"]
