"""MoE FFN: equals a per-token loop reference, counts drops exactly, aux loss formula,
gradients, per-layer placement, KV-cache decoding, training, config errors."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax import config as config_lib
from v41jax.config import ModelConfig, MoEConfig
from v41jax.decode import decode_step, generate, prefill
from v41jax.model import MoE, Transformer, expert_capacity, init_params, moe_metrics, routed_experts
from v41jax.sharding import make_mesh
from v41jax.train.state import TrainState, make_state_fns
from v41jax.train.step import make_train_step

# jitted: eager op-by-op dispatch is several times slower on the CPU test machine
routed = jax.jit(routed_experts, static_argnames=("top_k", "capacity_factor"))


def silu(v):
    return v / (1.0 + np.exp(-v))


def moe_reference(x, p, top_k, capacity_factor, shared=None):
    """Plain loops: per sequence, slots in choice-major order claim an expert's next free
    row until C are taken; each token sums gate * expert(x) over its kept choices.
    Returns (y [B, T, D], dropped slot count, slots per expert [E])."""
    x = np.asarray(x, np.float64)
    p = {k: np.asarray(p[k], np.float64) for k in ("router", "w_gate", "w_up", "w_down")}
    b, t, _ = x.shape
    e = p["router"].shape[1]
    cap = expert_capacity(t, e, top_k, capacity_factor)
    y, dropped, load = np.zeros_like(x), 0, np.zeros(e)
    for row in range(b):
        choices, gates = [], []
        for tok in range(t):
            logits = x[row, tok] @ p["router"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = np.argsort(-probs, kind="stable")[:top_k]
            ranked = np.sort(logits)[::-1]
            assert top_k == e or ranked[top_k - 1] - ranked[top_k] > 1e-4, "near-tie input"
            choices.append(top)
            gates.append(probs[top] / probs[top].sum())
        used = np.zeros(e, int)
        for j in range(top_k):
            for tok in range(t):
                ex = choices[tok][j]
                load[ex] += 1
                if used[ex] >= cap:
                    dropped += 1
                    continue
                used[ex] += 1
                h = silu(x[row, tok] @ p["w_gate"][ex]) * (x[row, tok] @ p["w_up"][ex])
                y[row, tok] += gates[tok][j] * (h @ p["w_down"][ex])
        if shared is not None:
            h = silu(x[row] @ shared["w_gate"]) * (x[row] @ shared["w_up"])
            y[row] += h @ shared["w_down"]
    return y, dropped, load


def normal(shape, seed=0, std=1.0):
    """numpy draws: jax.random would compile a sampler per shape (seconds on this CPU)."""
    return jnp.asarray(np.random.default_rng(seed).normal(0, std, shape), jnp.float32)


def random_params(init_fn, seed=1, std=0.3):
    """Params shaped like `init_fn()`'s, drawn with numpy (no RNG-init compile). Norm scales
    are 1, routers N(0, 1) (well-separated scores, so float32 and float64 routing agree),
    everything else N(0, std^2)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(leaf.shape, leaf.dtype)
        scale = 1.0 if "router" in name else std
        return jnp.asarray(rng.normal(0, scale, leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, nn.unbox(jax.eval_shape(init_fn)))


def make_moe(e, top_k, shared, cf, d_expert):
    cfg = MoEConfig(num_experts=e, top_k=top_k, num_shared_experts=shared, capacity_factor=cf)
    return MoE(cfg, d_expert=d_expert)


def moe_params(module, x):
    return random_params(lambda: module.init(jax.random.key(0), x))["params"]


def run_moe(module, x):
    params = moe_params(module, x)
    y, state = jax.jit(lambda p, x: module.apply({"params": p}, x, mutable=["intermediates"]))(
        params, x
    )
    sown = {k: v[0] for k, v in state["intermediates"].items()}
    return params, y, sown


CASES = [  # (B, T, D, E, F, top_k, shared, capacity_factor)
    (2, 7, 12, 3, 10, 1, 0, 0.0),
    (2, 7, 12, 3, 10, 2, 1, 0.0),
    (1, 9, 8, 4, 6, 2, 0, 0.0),
    (3, 11, 8, 5, 6, 2, 1, 0.6),
    (2, 13, 8, 4, 6, 1, 0, 1.0),
    (2, 5, 8, 3, 6, 3, 1, 0.0),  # top_k == E
]


# Slow: top-1 and top-2 without a shared expert and no capacity limit (top-1 stays fast with
# a capacity limit, top-2 with a shared expert).
@pytest.mark.parametrize(
    "b,t,d,e,f,k,s,cf",
    [pytest.param(*c, marks=pytest.mark.slow if i in (0, 2) else ()) for i, c in enumerate(CASES)],
)
def test_moe_equals_per_token_reference(b, t, d, e, f, k, s, cf):
    x = normal((b, t, d), 0)
    params, y, sown = run_moe(make_moe(e, k, s, cf, f), x)
    want, dropped, load = moe_reference(x, params, k, cf, params.get("shared"))
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    slots = b * t * k
    assert float(sown["moe_dropped_fraction"]) == pytest.approx(dropped / slots)
    np.testing.assert_allclose(sown["moe_expert_load"], load / slots, atol=1e-7)
    if cf == 0:
        assert dropped == 0
    if cf == 0.6:
        assert dropped > 0  # the capacity case really drops


def test_dropless_never_drops_even_when_routing_collapses():
    # every token's scores favour expert 0 then 1: one expert gets all T first choices
    b, t, d, e = 2, 9, 4, 4
    x = jnp.abs(normal((b, t, d), 0)) + 0.1
    router = jnp.zeros((d, e)).at[:, 0].set(5.0).at[:, 1].set(2.0)
    p = {
        "router": router,
        "w_gate": normal((e, d, 6), 1),
        "w_up": normal((e, d, 6), 2),
        "w_down": normal((e, 6, d), 3),
    }
    y, stats = routed(x, p, top_k=2)
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(stats.expert_load, [0.5, 0.5, 0, 0])
    np.testing.assert_allclose(y, moe_reference(x, p, 2, 0.0)[0], rtol=1e-4, atol=1e-4)
    # capacity 1.0: C = ceil(9 * 2 / 4) = 5 rows, so experts 0 and 1 each drop 9 - 5 slots
    _, stats = routed(x, p, top_k=2, capacity_factor=1.0)
    assert float(stats.dropped_fraction) == pytest.approx(2 * b * 4 / (b * t * 2))


def test_capacity_at_least_t_equals_dropless():
    x = normal((2, 6, 8), 0)
    module = make_moe(4, 2, 0, 0.0, 5)
    params = moe_params(module, x)
    y0 = jax.jit(module.apply)({"params": params}, x)
    wide = dataclasses.replace(module, cfg=dataclasses.replace(module.cfg, capacity_factor=2.0))
    np.testing.assert_array_equal(y0, jax.jit(wide.apply)({"params": params}, x))
    assert expert_capacity(6, 4, 2, 2.0) == 6 and expert_capacity(6, 4, 2, 1.0) == 3


def test_aux_loss_hand_case():
    # E = 2, k = 1, router = identity: tokens [a, 0] x3 and [0, a] x1 with a = ln 3 have
    # probs [3/4, 1/4] and [1/4, 3/4]: f = [3/4, 1/4], P = [5/8, 3/8],
    # aux = 2 * (3/4 * 5/8 + 1/4 * 3/8) = 9/8.
    a = math.log(3.0)
    x = jnp.array([[[a, 0.0], [a, 0.0], [0.0, a], [a, 0.0]]])
    p = {"router": jnp.eye(2), "w_gate": jnp.ones((2, 2, 3)), "w_up": jnp.ones((2, 2, 3))}
    p["w_down"] = jnp.ones((2, 3, 2))
    _, stats = routed(x, p, top_k=1)
    assert float(stats.aux_loss) == pytest.approx(9 / 8, rel=1e-6)
    np.testing.assert_allclose(stats.expert_load, [0.75, 0.25])


@pytest.mark.parametrize("k", [1, 2])
def test_gradients_reach_router_and_experts(k):
    x = normal((2, 7, 8), 0)
    module = make_moe(4, k, 1, 0.0, 6)
    params = moe_params(module, x)

    def loss(params, x):
        y, state = module.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.mean(y**2) + 0.01 * state["intermediates"]["moe_aux_loss"][0]

    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for name, g in jax.tree_util.tree_leaves_with_path(g_params):
        assert np.all(np.isfinite(g)) and np.any(g != 0), name
    assert np.any(g_x != 0)


TINY = ModelConfig(
    vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48, max_seq_len=32
)
MOE = dataclasses.replace(
    TINY, moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, d_expert=16, layer_ids=(1,))
)


def test_ffn_kind_per_layer_and_logical_axes():
    boxed = jax.eval_shape(lambda: init_params(MOE, jax.random.key(0)))
    assert "router" not in boxed["block_0"]["ffn"] and "router" not in boxed["block_2"]["ffn"]
    ffn = boxed["block_1"]["ffn"]
    assert ffn["w_gate"].names == ("experts", "embed", "mlp") and ffn["w_gate"].value.shape == (
        4,
        32,
        16,
    )
    assert ffn["w_down"].names == ("experts", "mlp", "embed")
    assert ffn["router"].names == ("embed", "experts")
    assert ffn["shared"]["w_up"].value.shape == (32, 16)
    every = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, layer_ids=()))
    boxed = jax.eval_shape(lambda: init_params(every, jax.random.key(0)))
    # every layer MoE: one scanned run, experts stacked [L, E, D, F]
    assert set(boxed) == {
        "embed",
        "final_norm",
        "layers_0_2",
    }
    assert boxed["layers_0_2"]["ffn"]["router"].value.shape == (3, 32, 4)


def test_kv_cache_decoding_and_generate_match_the_full_forward():
    params = random_params(lambda: init_params(MOE, jax.random.key(0)))
    b, t = 2, 10
    toks = jnp.asarray(np.random.default_rng(1).integers(0, MOE.vocab_size, (b, t)), jnp.int32)
    full = np.asarray(jax.jit(Transformer(MOE).apply)({"params": params}, toks).logits)
    lengths = np.array([3, 6])
    last, state = prefill(params, MOE, toks, jnp.asarray(lengths))
    np.testing.assert_allclose(last, full[np.arange(b), lengths - 1], atol=1e-5)
    for i in range(t - lengths.max()):
        pos = lengths + i
        logits, state = decode_step(params, MOE, toks[np.arange(b), pos], state, jnp.asarray(pos))
        np.testing.assert_allclose(logits, full[np.arange(b), pos], atol=1e-5)
    out = generate(params, MOE, toks, jnp.asarray(lengths), max_new_tokens=3)  # greedy
    assert out.shape == (b, 3)
    np.testing.assert_array_equal(out[:, 0], full[np.arange(b), lengths - 1].argmax(-1))


def test_tiny_moe_model_trains_and_reports_metrics():
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        [
            "train.steps=8",
            "optim.warmup_steps=1",
            "model.moe.num_experts=4",
            "model.moe.num_shared_experts=1",
            "model.moe.d_expert=48",
            "model.moe.capacity_factor=1.0",
            "mesh.data=1",
        ],
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    model, optimizer, _, shardings, _ = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    # numpy-drawn params instead of init_fn: its RNG initialisers take ~5 s to compile here
    params = random_params(lambda: init_params(cfg.model, jax.random.key(0)), std=0.02)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=jax.jit(optimizer.init)(params),
        rng=jax.random.key_data(jax.random.key(0)),
    )
    state = jax.device_put(state, shardings)
    b, t = cfg.data.global_batch_size, cfg.data.seq_len
    toks = np.random.default_rng(0).integers(0, 64, (b, t + 1)).astype(np.int32)
    batch = {
        "inputs": toks[:, :-1],
        "targets": toks[:, 1:],
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
        "segment_ids": np.zeros((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.float32),
    }
    losses = []
    for _ in range(cfg.train.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        aux, ce = float(metrics["moe_aux_loss"]), float(metrics["ce"])
        assert float(metrics["loss"]) == pytest.approx(ce + 0.01 * aux, rel=1e-5)
        assert 1.0 <= aux <= 4.0 and 0.0 <= float(metrics["moe_dropped_fraction"]) < 1.0
        assert float(metrics["moe_max_load"]) >= 1.0
    assert losses[-1] < losses[0] - 0.5, losses


def test_dense_config_has_no_moe_params_or_metrics():
    boxed = jax.eval_shape(lambda: init_params(TINY, jax.random.key(0)))
    assert set(boxed["layers_0_2"]["ffn"]) == {"w_gate", "w_up", "w_down"}
    assert moe_metrics({"block_0": {"ffn_mix": {"h_res": (jnp.eye(2),)}}}) == {}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 4, "top_k": 5}, "model.moe.top_k=5"),
        ({"num_experts": 4, "top_k": 0}, "model.moe.top_k=0"),
        ({"num_experts": -1}, "model.moe.num_experts=-1"),
        ({"d_expert": -8}, "model.moe.d_expert=-8"),
        ({"capacity_factor": -0.5}, "model.moe.capacity_factor=-0.5"),
        ({"aux_loss_weight": -1.0}, "model.moe.aux_loss_weight=-1.0"),
        ({"balance": "bias"}, "model.moe.balance='bias'"),
        ({"balance": "sinkhorn"}, "model.moe.balance='sinkhorn'"),
    ],
)
def test_moe_config_errors_name_the_value(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        MoEConfig(**change)


@pytest.mark.parametrize("ids", ["1,5", "1,1", "-1"])
def test_moe_layer_ids_validated_against_the_model(ids):
    with pytest.raises(ValueError, match="model.moe.layer_ids"):
        config_lib.override(config_lib.get_config("tiny"), [f"model.moe.layer_ids={ids}"])
