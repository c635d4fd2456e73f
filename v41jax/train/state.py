"""Train state (params, optimizer state, step, RNG) created directly in its sharded layout.

`abstract_train_state` evaluates the init function abstractly, so shardings are known before
any memory is allocated: params are born sharded (FSDP never materialises a full replica),
and checkpoint restore reads each shard straight into place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh

from v41jax import sharding
from v41jax.config import DENSE_TABLE_OPTIMIZERS, Config, OptimConfig
from v41jax.engram.training import table_strategy
from v41jax.engram.training.sparse import split_tables
from v41jax.model import Transformer, feature_param_groups, init_inputs
from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA
from v41jax.train.optimizer import make_optimizer, optimizer_groups, schedule_length


@struct.dataclass
class TrainState:
    """step: int32 []; params/opt_state: pytrees; rng: uint32 [2] raw key (checkpointable)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def optimizer_config(cfg: Config) -> OptimConfig:
    """`cfg.optim` with the groups the model's features ask for put first (first match wins;
    e.g. Engram's tables, `feature_param_groups`)."""
    groups = feature_param_groups(cfg.model, cfg.optim.tables_trained_by)
    if not groups:
        return cfg.optim
    return dataclasses.replace(cfg.optim, param_groups=(*groups, *cfg.optim.param_groups))


def describe_optimizer(cfg: Config, state_params) -> list[dict]:
    """Each optimizer group of the run with its rule, peak LR and scaling rule
    (`optimizer_groups`), for the params of its TrainState (`state_params`, plain or
    ShapeDtypeStructs), plus a row for row-sparse Engram tables, which optax does not see."""
    tables = table_strategy(cfg)
    optim = tables.optax_config(optimizer_config(cfg))
    rows = optimizer_groups(optim, schedule_length(cfg), tables.optax_params(state_params))
    kind, engram = cfg.optim.table_optimizer, cfg.model.engram
    if engram.enabled and kind not in DENSE_TABLE_OPTIMIZERS:
        gamma = SINKHORN_GAMMA if kind == "sinkhorn_sparse" else 1.0
        scaling = f"lr x {engram.table_lr_scale:g}" + (f" x gamma {gamma:g}" if gamma != 1 else "")
        rows.append(
            {
                "group": "engram_tables",
                "rule": f"{kind} (row-sparse, {engram.table_placement} tables)",
                "peak_lr": cfg.optim.lr * engram.table_lr_scale * gamma,
                "scaling": scaling,
                "weight_decay": engram.table_weight_decay,
                "leaves": len(engram.layer_ids),
                "params": None,  # kept outside the state (host, file) or not counted here
            }
        )
    return rows


def build_model(cfg: Config) -> Transformer:
    return Transformer(cfg.model)


def _init_params(model: nn.Module, cfg: Config, rng: jax.Array):
    tokens, extras = init_inputs(cfg.model)
    return model.init(rng, tokens, extras=extras)["params"]


def init_table_arrays(cfg: Config, seed: int) -> dict:
    """{Engram layer: table [R, C] numpy} as `init_fn(seed)` would make them on device,
    computed on the host CPU (`TableStrategy.open`'s init_tables, for tables kept outside
    the params)."""
    model = build_model(cfg)

    def tables():
        key = jax.random.fold_in(jax.random.PRNGKey(seed), 0)
        flat = split_tables(nn.unbox(_init_params(model, cfg, key)))[1]
        return {int(str(p[-3]).rsplit("_", 1)[-1]): t for p, t in flat.items()}

    with jax.default_device(jax.devices("cpu")[0]):
        return {k: np.array(v) for k, v in jax.jit(tables)().items()}


def make_state_fns(cfg: Config, mesh: Mesh):
    """Returns (model, optimizer, init_fn, state_shardings, abstract_state).

    init_fn(seed) -> TrainState, jitted with out_shardings = state_shardings.
    abstract_state: TrainState of ShapeDtypeStructs carrying those shardings (for restore).
    The Engram tables' placement (`v41jax.engram.training`) decides which params the state
    holds, which of them optax covers and the optimizer state's layout.
    """
    model = build_model(cfg)
    tables = table_strategy(cfg)
    boxed = tables.state_params(
        jax.eval_shape(lambda: _init_params(model, cfg, jax.random.PRNGKey(0)))
    )
    optimizer = make_optimizer(
        tables.optax_config(optimizer_config(cfg)),
        schedule_length(cfg),
        tables.optax_params(nn.unbox(boxed)),
    )

    def init_opt_state(params):
        return tables.init_opt_state(optimizer, params)

    def init_state(seed: jax.Array) -> TrainState:
        key = jax.random.PRNGKey(seed)
        params = nn.unbox(_init_params(model, cfg, jax.random.fold_in(key, 0)))
        params = tables.state_params(params)  # tables kept elsewhere are never built here
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=init_opt_state(params),
            rng=jax.random.fold_in(key, 1),
        )

    # The optimizer is initialised from the BOXED params here: optax maps its moments over
    # the params' leaves, so Adam's mu/nu (also inside multi_transform's group states) carry
    # their param's logical axes, and one pass over the annotations shards the whole state;
    # counts and other unboxed leaves are replicated.
    abstract_boxed_state = jax.eval_shape(
        lambda: TrainState(
            step=jnp.zeros((), jnp.int32),
            params=boxed,
            opt_state=init_opt_state(boxed),
            rng=jax.random.PRNGKey(0),
        )
    )
    state_shardings = tables.opt_state_shardings(
        sharding.tree_shardings(mesh, abstract_boxed_state)
    )
    init_fn = jax.jit(init_state, static_argnums=(), out_shardings=state_shardings)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.unbox(abstract_boxed_state),
        state_shardings,
    )
    return model, optimizer, init_fn, state_shardings, abstract_state
