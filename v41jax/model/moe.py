"""Mixture-of-experts FFN: top-k routed SwiGLU experts plus always-on shared experts.

Per token x_t (D wide), with E routed experts, k = top_k and S shared experts:

    p_t = softmax(x_t W_router)                                  float32 [E]
    K_t = the k largest entries of p_t;  g_{t,e} = p_{t,e} / sum_{e' in K_t} p_{t,e'}
    y_t = Shared(x_t) + sum_{e in K_t} g_{t,e} SwiGLU_e(x_t)     Shared: one SwiGLU of S*F
    aux = E * sum_e f_e P_e                                      (Switch eq. 4, GShard)

f_e is the fraction of the N*k routed token-slots sent to expert e (before capacity drops,
so it sums to 1) and P_e = mean_t p_{t,e}: aux is 1 at perfect balance and E when every token
picks the same experts; only P carries a gradient. Sources: Shazeer et al. 2017 (top-k
gating), GShard (Lepikhin et al. 2020), Switch Transformer (Fedus et al. 2021), DeepSeekMoE
(Dai et al. 2024, shared experts).

Dispatch (GShard): each sequence is a group. Its T*k (token, choice) slots queue per expert
in choice-major order (every first choice before any second choice, each by position); the
first C of each queue fill an expert buffer [B, E, C, D], the experts run as matmuls batched
over E, and every slot reads its row back. A slot past C is dropped (it adds nothing; its
token keeps its other choices, the shared experts and the residual; gates are not
renormalised) and counted. C = ceil(cf * T * k / E) for capacity_factor cf > 0; cf = 0 is
dropless, C = T, the most one expert can get from a sequence since a token's k choices are
distinct. Why buffers and not `jax.lax.ragged_dot`: in jaxlib 0.10 on CPU and CUDA it lowers
to the same masked dense matmul over [E, N, D] (no grouped-GEMM path, see
marin-community/marin#7012), and its sort over all B*T tokens would gather a data-parallel
batch; buffers keep every op batched over B. Expert FLOPs are E*C/(T*k) times the active
ones: cf at capacity, E/k dropless (fine at small scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig, MoEConfig
from v41jax.model.layers import Dtype, SwiGLU, normal_init

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]
SOWN = ("moe_aux_loss", "moe_dropped_fraction", "moe_expert_load")  # intermediates per layer


class MoEStats(NamedTuple):
    """Routing statistics of one MoE layer call (all float32, no gradient but `aux_loss`'s).

    aux_loss: scalar `E * sum_e f_e P_e`. dropped_fraction: scalar, dropped slots / (N k).
    expert_load: [E] f_e, the fraction of routed slots per expert before drops (sums to 1).
    """

    aux_loss: jax.Array
    dropped_fraction: jax.Array
    expert_load: jax.Array


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Layer `layer` has an MoE FFN: MoE is on and the layer is listed (or none are)."""
    return cfg.moe.num_experts > 0 and (not cfg.moe.layer_ids or layer in cfg.moe.layer_ids)


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_layers) if is_moe_layer(cfg, i))


def expert_width(cfg: ModelConfig) -> int:
    """SwiGLU hidden width F of one routed (or shared) expert."""
    return cfg.moe.d_expert or cfg.d_ff


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Buffer rows per expert and group of `tokens`: ceil(cf * T * k / E), at most T (an
    expert never gets more than T slots from T tokens); T when cf = 0 (dropless)."""
    if capacity_factor <= 0:
        return tokens
    # the 1e-9 keeps an exact product (1.0 * 8 * 2 / 4) from rounding up to the next int
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts - 1e-9)))


def route(
    x_BxTxD: jax.Array, router_DxE: jax.Array, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router in float32: (gates [B, T, k] renormalised over the k chosen, expert ids int32
    [B, T, k] by decreasing score, probabilities [B, T, E])."""
    logits_BxTxE = jnp.einsum(
        "btd,de->bte", x_BxTxD.astype(jnp.float32), router_DxE.astype(jnp.float32)
    )
    probs_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
    top_BxTxK, experts_BxTxK = jax.lax.top_k(probs_BxTxE, top_k)
    gates_BxTxK = top_BxTxK / jnp.sum(top_BxTxK, axis=-1, keepdims=True)
    return gates_BxTxK, experts_BxTxK.astype(jnp.int32), probs_BxTxE


def dispatch_slots(
    experts_BxTxK: jax.Array, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Buffer row of every (choice, token) slot, choice-major (slot a = j * T + t).

    Returns (row int32 [B, k*T] in [0, E*C], where E*C means dropped; keep bool [B, k*T];
    slots per expert before drops, int32 [B, E]). A slot's rank in its expert's queue is
    the number of earlier slots (in choice-major order) that chose the same expert.
    """
    b, t, k = experts_BxTxK.shape
    e_BxA = experts_BxTxK.transpose(0, 2, 1).reshape(b, k * t)
    onehot_BxAxE = jax.nn.one_hot(e_BxA, num_experts, dtype=jnp.int32)
    rank_BxA = jnp.sum(jnp.cumsum(onehot_BxAxE, axis=1) * onehot_BxAxE, axis=-1) - 1
    keep_BxA = rank_BxA < capacity
    row_BxA = jnp.where(keep_BxA, e_BxA * capacity + rank_BxA, num_experts * capacity)
    return row_BxA.astype(jnp.int32), keep_BxA, jnp.sum(onehot_BxAxE, axis=1)


def routed_experts(
    x_BxTxD: jax.Array,
    params: Mapping[str, jax.Array],
    top_k: int,
    capacity_factor: float = 0.0,
    constrain: Constrain | None = None,
) -> tuple[jax.Array, MoEStats]:
    """The routed part `sum_{e in K_t} g_{t,e} SwiGLU_e(x_t)`, [B, T, D] -> [B, T, D].

    params: `router` [D, E] (used in float32), `w_gate`, `w_up` [E, D, F], `w_down` [E, F, D]
    (matmuls in x's dtype). `constrain(array, logical_axes)` pins the expert buffers'
    sharding (the Linen shell passes `nn.with_logical_constraint`). Returns (y in x's dtype,
    MoEStats). Each sequence is a dispatch group (see the module docstring).
    """
    constrain = constrain or (lambda a, _names: a)
    b, t, d = x_BxTxD.shape
    e = params["router"].shape[-1]
    c = expert_capacity(t, e, top_k, capacity_factor)
    gates_BxTxK, experts_BxTxK, probs_BxTxE = route(x_BxTxD, params["router"], top_k)
    row_BxA, keep_BxA, counts_BxE = dispatch_slots(experts_BxTxK, e, c)

    # Which token fills each buffer row: T points at an appended zero row (an empty row),
    # so the buffer is a gather of x whose gradient is a scatter-add back to the tokens.
    token_BxA = jnp.broadcast_to(jnp.tile(jnp.arange(t, dtype=jnp.int32), top_k), row_BxA.shape)
    fill_BxR = jax.vmap(lambda rows, toks: jnp.full((e * c + 1,), t).at[rows].set(toks))(
        row_BxA, token_BxA
    )[:, : e * c]
    x_pad_BxT1xD = jnp.pad(x_BxTxD, ((0, 0), (0, 1), (0, 0)))
    buf_BxExCxD = jnp.take_along_axis(x_pad_BxT1xD, fill_BxR[..., None], axis=1)
    buf_BxExCxD = constrain(
        buf_BxExCxD.reshape(b, e, c, d), ("batch", "act_experts", None, "act_embed")
    )

    # Empty rows are zeros and SwiGLU(0) = 0 (no biases), so they add nothing below.
    gate_BxExCxF = jnp.einsum("becd,edf->becf", buf_BxExCxD, params["w_gate"])
    up_BxExCxF = jnp.einsum("becd,edf->becf", buf_BxExCxD, params["w_up"])
    h_BxExCxF = constrain(
        jax.nn.silu(gate_BxExCxF) * up_BxExCxF, ("batch", "act_experts", None, "act_mlp")
    )
    out_BxExCxD = jnp.einsum("becf,efd->becd", h_BxExCxF, params["w_down"])

    # Combine: each slot reads its row (dropped slots read an appended zero row).
    out_BxR1xD = jnp.pad(out_BxExCxD.reshape(b, e * c, d), ((0, 0), (0, 1), (0, 0)))
    y_BxAxD = jnp.take_along_axis(out_BxR1xD, row_BxA[..., None], axis=1)
    y_BxKxTxD = y_BxAxD.reshape(b, top_k, t, d).astype(jnp.float32)
    y_BxTxD = jnp.einsum("bktd,btk->btd", y_BxKxTxD, gates_BxTxK)

    slots = b * t * top_k
    load_E = jnp.sum(counts_BxE, axis=0).astype(jnp.float32) / slots
    aux = e * jnp.sum(load_E * jnp.mean(probs_BxTxE, axis=(0, 1)))
    dropped = jnp.sum(~keep_BxA).astype(jnp.float32) / slots
    return y_BxTxD.astype(x_BxTxD.dtype), MoEStats(aux, dropped, load_E)


def moe_summary(stats: Sequence[MoEStats]) -> dict[str, jax.Array]:
    """Step metrics of the MoE layers of one forward pass, from their `MoEStats` in depth
    order: `moe_aux_loss` and `moe_dropped_fraction` (means over MoE layers) and
    `moe_max_load` (max over layers of max_e f_e / mean_e f_e; 1 = perfect balance).
    {} without MoE layers. The training loss adds `aux_loss_weight * moe_aux_loss`."""
    if not stats:
        return {}
    return {
        "moe_aux_loss": jnp.mean(jnp.stack([s.aux_loss for s in stats])),
        "moe_dropped_fraction": jnp.mean(jnp.stack([s.dropped_fraction for s in stats])),
        "moe_max_load": jnp.max(
            jnp.stack([s.expert_load.max() * s.expert_load.shape[0] for s in stats])
        ),
    }


def moe_metrics(intermediates: Mapping) -> dict[str, jax.Array]:
    """`moe_summary` of the `intermediates` sown by the MoE layers of one forward pass
    (`apply(..., mutable=["intermediates"])`). {} without MoE."""
    sown = {name: [] for name in SOWN}
    for path, values in traverse_util.flatten_dict(dict(intermediates)).items():
        if path[-1] in sown:
            sown[path[-1]].extend(values)
    return moe_summary([MoEStats(*v) for v in zip(*(sown[n] for n in SOWN), strict=True)])


class MoE(nn.Module):
    """MoE FFN [B, T, D] -> [B, T, D] (module docstring): params `router` [D, E] (embed,
    experts), `w_gate`, `w_up` [E, D, F] (experts, embed, mlp), `w_down` [E, F, D] (experts,
    mlp, embed) and, with shared experts, `shared` (a SwiGLU of width S*F).

    Sows `moe_aux_loss`, `moe_dropped_fraction` and `moe_expert_load` into "intermediates"
    (a no-op unless the caller makes that collection mutable). With `return_stats` the call
    returns (y, `MoEStats`) instead of y: how the block hands them to `ModelOutput`.
    """

    cfg: MoEConfig
    d_expert: int
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    return_stats: bool = False

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array | tuple[jax.Array, MoEStats]:
        c = self.cfg
        if c.num_experts < 1:
            raise ValueError(f"MoE needs moe.num_experts >= 1, got {c.num_experts}")
        d, e, f = x_BxTxD.shape[-1], c.num_experts, self.d_expert
        names_in, names_out = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")

        def param(name, std, names, shape):
            return self.param(name, normal_init(std, names), shape, self.param_dtype)

        params = {
            "router": param("router", self.init_std, ("embed", "experts"), (d, e)),
            "w_gate": param("w_gate", self.init_std, names_in, (e, d, f)),
            "w_up": param("w_up", self.init_std, names_in, (e, d, f)),
            "w_down": param("w_down", self.out_init_std, names_out, (e, f, d)),
        }
        # the router stays float32 (`route` upcasts): bf16 scores would flip near-ties
        params = {k: v if k == "router" else v.astype(self.dtype) for k, v in params.items()}
        y_BxTxD, stats = routed_experts(
            x_BxTxD.astype(self.dtype),
            params,
            c.top_k,
            c.capacity_factor,
            nn.with_logical_constraint,
        )
        for name, value in zip(SOWN, stats, strict=True):
            self.sow("intermediates", name, value)
        if c.num_shared_experts:
            shared = SwiGLU(
                d_ff=c.num_shared_experts * f,
                init_std=self.init_std,
                out_init_std=self.out_init_std,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="shared",
            )
            y_BxTxD = y_BxTxD + shared(x_BxTxD)
        return (y_BxTxD, stats) if self.return_stats else y_BxTxD
