"""Row-sparse Engram table training inside the train step (`optim.table_optimizer`).

With `sparse_adam`, `rowwise_adagrad` or `sinkhorn_sparse` the tables stay in `state.params`
(same checkpoint layout as dense training) but leave optax: the optimizer state is

    {"dense": optax state of the other params, "tables": {table path: row-sparse state}}

and a step, per Engram layer with flat row ids x [B, T, H]:

    rows u, slots s = unique(x)           u [N] padded with R (N = B T H), u[s] = x
    e = T[u]                              the rows the batch reads, [N, C]
    loss(params without tables, e)        the model reads e[s] (`ENGRAM_ROWS_PREFIX` extras)
    g_e = d loss / d e                    [N, C]: one gradient per distinct row
    T, state <- sparse_update(T, state, u, g_e)        (`v41jax.engram.table_optim`)

(sinkhorn_sparse: the last line runs after the step, in the program host tables run,
`apply_deferred`: its balance amplifies the rounding differences between programs.)

so no array of the table's size is read, written or differentiated except in place. The
global-norm clip covers the other params' gradients and g_e together, as dense training's
clip covers the dense table gradient (whose only non-zero rows are g_e).

Under a mesh that splits the tables' rows over every device (`engram_rows` in the sharding
rules), each layer instead reads e = T[x] [B, T, H C] by all-to-all from the row owners, and
its gradient goes back the same way: each owner sums every source's cotangents for its rows
and updates its own shard of the table and of the optimizer state in place
(`v41jax.engram.sharded_update`), so no device holds another shard's rows or gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import traverse_util

from v41jax import sharding
from v41jax.config import Config
from v41jax.engram import flat_row_ids, table_optim
from v41jax.engram.sharded import ENGRAM_ROW_AXIS
from v41jax.engram.sharded_update import (
    owner_gradients,
    row_shard_plan,
    sharded_rows,
    sharded_sparse_update,
)
from v41jax.engram.training.device import DeviceTableStrategy
from v41jax.engram.tree_keys import TABLE_LEAF, engram_ids_key, engram_rows_key
from v41jax.engram.tree_keys import engram_table_paths as table_paths

# Row-sparse kinds whose table update leaves the jitted step for its own program, the one
# host tables run (`table_optim.gathered_update_program`): the Sinkhorn balance amplifies the
# rounding differences between programs. Row-sharded layers (all-to-all) update in the step.
DEFERRED_KINDS = ("sinkhorn_sparse",)


def table_update_hyper(cfg: Config) -> dict:
    """`table_optim.sparse_update`'s hyperparameters of a run (all but the step)."""
    o, engram = cfg.optim, cfg.model.engram
    return dict(
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=engram.table_weight_decay,
        momentum=engram.table_momentum,
    )


def split_tables(params):
    """(params without the tables, {path: table})."""
    flat = traverse_util.flatten_dict(params)
    tables = {p: v for p, v in flat.items() if p[-2:] == TABLE_LEAF}
    rest = traverse_util.unflatten_dict({p: v for p, v in flat.items() if p not in tables})
    return rest, tables


def merge_tables(rest, tables: dict):
    flat = traverse_util.flatten_dict(rest)
    return traverse_util.unflatten_dict({**flat, **tables})


def state_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def init_table_states(kind: str, tables: dict) -> dict:
    return {state_key(p): table_optim.init_state(kind, *t.shape) for p, t in tables.items()}


def table_state_shardings(table_states: dict, param_shardings) -> dict:
    """Each table's state takes its table's (row) sharding: m, v [R, C]; k, acc [R, 1]."""
    flat = traverse_util.flatten_dict(param_shardings)
    by_key = {state_key(p): s for p, s in flat.items() if p[-2:] == TABLE_LEAF}
    return {k: {name: by_key[k] for name in st} for k, st in table_states.items()}


def row_shard_plans(cfg: Config, tables: dict, batch_size: int) -> dict:
    """{layer: exchange plan} for the layers whose table the active mesh splits by rows over
    all its devices (`row_shard_plan`); empty outside a mesh or on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    row_axes, batch_axes = sharding.mesh_axes_of(ENGRAM_ROW_AXIS), sharding.BATCH_MESH_AXES
    plans = {}
    for layer, path in table_paths(traverse_util.unflatten_dict(tables)).items():
        plan = row_shard_plan(mesh, tables[path].shape, batch_size, row_axes, batch_axes)
        if plan is not None:
            plans[layer] = plan
    return plans


def gather_rows(cfg: Config, tables: dict, batch: dict, plans: dict | None = None):
    """{layer: (rows u [N], slots [B, T, H], e [N, C])} for every Engram layer of `batch`;
    a layer with a plan (`row_shard_plans`) gets (flat ids [B, T, H], None, e [B, T, H C])."""
    engram, plans = cfg.model.engram, plans or {}
    out = {}
    for layer, path in table_paths(traverse_util.unflatten_dict(tables)).items():
        table = tables[path]
        ids = flat_row_ids(engram, layer, batch[engram_ids_key(layer)])
        if layer in plans:
            out[layer] = (ids, None, sharded_rows(plans[layer], table, ids))
            continue
        rows, slots = table_optim.unique_rows(ids, table.shape[0])
        out[layer] = (rows, slots, table.at[rows].get(mode="fill", fill_value=0))
    return out


def with_rows(batch: dict, gathered: dict, rows_e: dict) -> dict:
    """The batch as the model reads it: ids replaced by slots, plus the gathered rows."""
    batch = dict(batch)
    for layer, (_, slots, _) in gathered.items():
        if slots is not None:  # per-position rows keep the ids
            batch[engram_ids_key(layer)] = slots
        batch[engram_rows_key(layer)] = rows_e[layer]
    return batch


def _grads_and_dense_update(
    cfg, forward_loss, optimizer, module_norms, state, rest, tables, batch, rows_e, owners=None
):
    """Loss gradients of the other params and of the gathered rows, clipped together
    (optax.clip_by_global_norm's rule), and the optax update of the other params.
    module_norms(prefix, tree) -> {name: norm}: the caller's per-module norm metrics.

    owners: {layer: (plan, flat ids)} for per-position rows; their gradients become the
    owners' row gradients (`owner_gradients`) before the norm, returned as {layer: rows}."""
    o, owner_rows = cfg.optim, {}

    def loss_fn(rest, rows_e):
        batch_e = dict(batch)
        for layer, e in rows_e.items():
            batch_e[engram_rows_key(layer)] = e
        return forward_loss(merge_tables(rest, tables), batch_e)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (_, metrics), (g_rest, g_rows) = grad_fn(rest, rows_e)
    for layer, (plan, ids) in (owners or {}).items():
        owner_rows[layer], g_rows[layer] = owner_gradients(plan, ids, g_rows[layer])
    grad_norm = optax.tree.norm((g_rest, g_rows))
    if o.grad_clip > 0:
        factor = jnp.where(grad_norm < o.grad_clip, 1.0, o.grad_clip / grad_norm)
        g_rest, g_rows = jax.tree.map(lambda g: g * factor, (g_rest, g_rows))
    updates, dense_state = optimizer.update(g_rest, state.opt_state["dense"], rest)
    norms = module_norms("grad_norm", g_rest) | module_norms("update_norm", updates)
    norms |= module_norms("grad_norm", {f"engram_rows_{k}": g for k, g in g_rows.items()})
    return (
        optax.apply_updates(rest, updates),
        dense_state,
        g_rows,
        dict(metrics, grad_norm=grad_norm, **norms),
        owner_rows,
    )


def host_train_step(cfg: Config, forward_loss, optimizer, schedule, module_norms):
    """train_step(state, batch) -> (state, metrics, {layer: row gradients [N, C]}) for host
    tables: the batch carries each layer's rows and slots (`HostTables.gather`), the params
    no tables, and the host applies the returned gradients (`HostTables.apply`)."""

    def train_step(state, batch):
        rows_e = {layer: batch[engram_rows_key(layer)] for layer in cfg.model.engram.layer_ids}
        rest, dense_state, g_rows, metrics, _ = _grads_and_dense_update(
            cfg, forward_loss, optimizer, module_norms, state, state.params, {}, batch, rows_e
        )
        new_state = state.replace(
            step=state.step + 1,
            params=rest,
            opt_state={"dense": dense_state, "tables": state.opt_state["tables"]},
        )
        return new_state, dict(metrics, lr=schedule(state.step)), g_rows

    return train_step


def sparse_train_step(cfg: Config, forward_loss, optimizer, schedule, module_norms):
    """train_step(state, batch) -> (state, metrics) of a row-sparse run (module doc).

    forward_loss(params, batch) -> (loss, metrics); optimizer: optax for the other params,
    without clipping (applied here over all gradients); schedule: the base learning rate;
    module_norms(prefix, tree) -> {name: norm} (the trainer's per-module norm metrics).
    """
    o, engram = cfg.optim, cfg.model.engram
    kind = o.table_optimizer
    defer = kind in DEFERRED_KINDS

    def train_step(state, batch):
        rest, tables = split_tables(state.params)
        plans = row_shard_plans(cfg, tables, next(iter(batch.values())).shape[0])
        gathered = gather_rows(cfg, tables, batch, plans)
        rows_e = {layer: e for layer, (_, _, e) in gathered.items()}
        owners = {layer: (plan, gathered[layer][0]) for layer, plan in plans.items()}
        rest, dense_state, g_rows, metrics, owner_rows = _grads_and_dense_update(
            cfg,
            forward_loss,
            optimizer,
            module_norms,
            state,
            rest,
            tables,
            with_rows(batch, gathered, rows_e),
            rows_e,
            owners,
        )
        lr = schedule(state.step) * engram.table_lr_scale
        # step: the step being taken (sinkhorn_sparse's decay)
        hyper = dict(table_update_hyper(cfg), step=state.step + 1)
        new_tables, table_states = dict(tables), dict(state.opt_state["tables"])
        paths = table_paths(traverse_util.unflatten_dict(tables))
        deferred = {}
        for layer, (rows, _, _) in gathered.items():
            path, key = paths[layer], state_key(paths[layer])
            if defer and layer not in plans:  # updated after the step (`apply_deferred`)
                num_rows = tables[path].shape[0]
                at = jnp.minimum(rows, num_rows - 1)  # fill entries: computed, discarded
                deferred[layer] = {
                    "rows": rows,
                    "table_rows": tables[path][at],
                    "state_rows": {k: v[at] for k, v in table_states[key].items()},
                    "grads": g_rows[layer],
                }
                continue
            if layer in plans:  # each owner updates its own shard with what it received
                new_tables[path], table_states[key] = sharded_sparse_update(
                    plans[layer],
                    kind,
                    tables[path],
                    table_states[key],
                    owner_rows[layer],
                    g_rows[layer],
                    lr,
                    **hyper,
                )
                continue
            new_tables[path], table_states[key] = table_optim.sparse_update(
                kind, tables[path], table_states[key], rows, g_rows[layer], lr, **hyper
            )
        opt_state = {"dense": dense_state, "tables": table_states}
        new_state = state.replace(
            step=state.step + 1, params=merge_tables(rest, new_tables), opt_state=opt_state
        )
        metrics = dict(metrics, lr=schedule(state.step))
        if defer:
            return new_state, metrics, {"lr": lr, "step": state.step + 1, "layers": deferred}
        return new_state, metrics

    return train_step


def apply_deferred(cfg: Config, state, deferred: dict):
    """The table update a sinkhorn_sparse step left for after it (`DEFERRED_KINDS`): per
    layer, `table_optim.gathered_update_program` on the rows the step gathered (the program
    host tables run), then their scatter into the table and its state, in place. Returns
    the state with the new tables and table states."""
    program = table_optim.gathered_update_program(
        cfg.optim.table_optimizer, **table_update_hyper(cfg)
    )
    rest, tables = split_tables(state.params)
    table_states = dict(state.opt_state["tables"])
    paths = table_paths(traverse_util.unflatten_dict(tables))
    for layer, d in deferred["layers"].items():
        path, key = paths[layer], state_key(paths[layer])
        keep = d["rows"] < tables[path].shape[0]
        new_rows, new_state = program(
            d["table_rows"], d["state_rows"], d["grads"], deferred["lr"], keep, deferred["step"]
        )
        tables[path], table_states[key] = _scatter_rows(
            tables[path], table_states[key], d["rows"], new_rows, new_state
        )
    opt_state = {**state.opt_state, "tables": table_states}
    return state.replace(params=merge_tables(rest, tables), opt_state=opt_state)


def _scatter_rows(table, table_state: dict, rows, new_rows, new_state: dict):
    """table[rows] = new_rows and each state[rows] = its new rows, in place (donated); fill
    ids (R) are dropped. The outputs keep the inputs' shardings."""
    shardings = (table.sharding, {k: v.sharding for k, v in table_state.items()})
    return _scatter_program(shardings[0], tuple(sorted(shardings[1].items())))(
        table, table_state, rows, new_rows, new_state
    )


@functools.cache
def _scatter_program(table_sharding, state_shardings: tuple):
    def scatter(table, table_state, rows, new_rows, new_state):
        out = {
            k: v.at[rows].set(new_state[k].astype(v.dtype), mode="drop")
            for k, v in table_state.items()
        }
        return table.at[rows].set(new_rows.astype(table.dtype), mode="drop"), out

    out_shardings = (table_sharding, dict(state_shardings))
    return jax.jit(scatter, donate_argnums=(0, 1), out_shardings=out_shardings)


class SparseTableStrategy(DeviceTableStrategy):
    """Row-sparse tables on the device (`optim.table_optimizer` sparse_adam,
    rowwise_adagrad or sinkhorn_sparse, `table_placement` "device"; module doc).

    Keeps: each table [R, C] in TrainState.params (the checkpoint layout of dense training);
    its row-sparse state in opt_state["tables"]["block_<l>/engram/table"] (sparse_adam: m, v
    [R, C], k [R, 1]; rowwise_adagrad: acc [R, 1]; sinkhorn_sparse: m [R, C], s [R, 1])
    with the table's row sharding; optax ({"dense": ...}) covers the other params,
    unclipped: the step clips all gradients.
    Step cost: per layer a gather of the batch's U <= B T H distinct rows [U, C] and a
    scatter of their update; nothing of the table's size is read or written."""

    name = "sparse"

    def optax_config(self, optim_cfg):
        return dataclasses.replace(optim_cfg, grad_clip=0.0)

    def optax_params(self, params):
        return split_tables(params)[0]

    def init_opt_state(self, optimizer, params):
        rest, tables = split_tables(params)
        tables = nn.unbox(tables)  # only their shapes are read
        kind = self.cfg.optim.table_optimizer
        return {"dense": optimizer.init(rest), "tables": init_table_states(kind, tables)}

    def opt_state_shardings(self, state_shardings):
        """Each table state takes its table's row sharding (`table_state_shardings`)."""
        tables = table_state_shardings(state_shardings.opt_state["tables"], state_shardings.params)
        return state_shardings.replace(opt_state={**state_shardings.opt_state, "tables": tables})

    def train_step(self, dense_step, forward_loss, optimizer, schedule, module_norms):
        return sparse_train_step(self.cfg, forward_loss, optimizer, schedule, module_norms)

    def step_out_shardings(self, out_shardings: tuple, replicated) -> tuple:
        if self.cfg.optim.table_optimizer in DEFERRED_KINDS:
            return (*out_shardings, replicated)  # the gathered rows `apply_deferred` reads
        return out_shardings

    def finish_step(self, outputs: tuple) -> tuple:
        """(state, metrics); for `DEFERRED_KINDS` after the table update the step left."""
        if self.cfg.optim.table_optimizer not in DEFERRED_KINDS:
            return outputs
        state, metrics, deferred = outputs
        return apply_deferred(self.cfg, state, deferred), metrics
