"""Transformer: shapes, dtypes, logical axes, causality, segments, GQA, bf16, hidden states."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax import sharding
from v41jax.config import MeshConfig, ModelConfig, get_config
from v41jax.model import (
    Embed,
    Transformer,
    count_params,
    init_params,
    model_flops_per_token,
    scan_tree,
    unscan_tree,
)

CFG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32
)
B, T = 2, 8
# "layers": the leading axis of the params a layer scan stacks
PARAM_AXES = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "layers"}


@functools.cache
def params_for(cfg: ModelConfig):
    return init_params(cfg, jax.random.key(0))


def abstract_params(cfg: ModelConfig):
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def tokens(seed=1, shape=(B, T), vocab=CFG.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def apply_eager(cfg, params, toks, *args, **kwargs):
    return Transformer(cfg).apply({"params": params}, toks, *args, **kwargs)


apply = jax.jit(apply_eager, static_argnames=("cfg", "hidden_layers"))


def test_shapes_and_dtypes():
    out = apply(CFG, params_for(CFG), tokens())
    assert out.logits.shape == (B, T, CFG.vocab_size) and out.logits.dtype == jnp.float32
    assert out.hidden == {} and out.cache is None
    assert np.all(np.isfinite(out.logits))


def test_every_param_has_logical_axes():
    params = params_for(CFG)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for box in leaves:
        assert len(box.names) == box.value.ndim and set(box.names) <= PARAM_AXES, box.names


def embed_perturbed_logits(cfg, params, toks, delta_BxTxD, **kwargs):
    """Logits with `delta` added to the embedding output (to differentiate w.r.t. it)."""

    def add_delta(next_fun, args, kw, context):
        out = next_fun(*args, **kw)
        if isinstance(context.module, Embed) and context.method_name == "__call__":
            out = out + delta_BxTxD
        return out

    with nn.intercept_methods(add_delta):
        return apply_eager(cfg, params, toks, **kwargs).logits


def test_causality_by_gradients():
    params, toks = params_for(CFG), tokens()
    delta = jnp.zeros((B, T, CFG.d_model))
    f = lambda d: embed_perturbed_logits(CFG, params, toks, d).sum(-1)  # [B, T]
    jac = jax.jit(jax.jacrev(f))(delta)  # [B, T, B, T, D]: d logits[b, t] / d emb[b', s]
    dep_TxT = np.abs(np.asarray(jac)).sum(-1)[np.arange(B), :, np.arange(B)].max(0)
    assert np.all(dep_TxT[np.triu_indices(T, 1)] == 0)  # nothing from the future
    assert np.all(dep_TxT[np.tril_indices(T)] > 0)  # everything from the past
    cross = np.abs(np.asarray(jac))[0, :, 1].sum()
    assert cross == 0  # rows of a batch are independent


def test_segments_do_not_attend_to_each_other():
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]] * B)
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]] * B)
    a = tokens(1)
    b = a.at[:, :3].set(tokens(2)[:, :3])  # change segment 1 only
    params = params_for(CFG)
    la, lb = (apply(CFG, params, x, pos, seg).logits for x in (a, b))
    np.testing.assert_allclose(la[:, 3:], lb[:, 3:], atol=1e-6)
    assert not np.allclose(la[:, :3], lb[:, :3], atol=1e-4)
    open_cfg = dataclasses.replace(CFG, segment_mask=False)
    la, lb = (apply(open_cfg, params, x, pos, seg).logits for x in (a, b))
    assert not np.allclose(la[:, 3:], lb[:, 3:], atol=1e-4)


def test_jit_matches_eager():
    params, toks = params_for(CFG), tokens()
    eager = apply_eager(CFG, params, toks).logits
    jitted = apply(CFG, params, toks).logits
    np.testing.assert_allclose(eager, jitted, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_weights():
    mha_cfg = dataclasses.replace(CFG, num_kv_heads=CFG.num_heads)
    params = nn.unbox(params_for(CFG))
    r = CFG.num_heads // CFG.num_kv_heads
    mha = unscan_tree(params, CFG.num_layers)  # per-block view (a copy of the dicts)
    for i in range(CFG.num_layers):
        attn = mha[f"block_{i}"]["attn"]
        attn["k"], attn["v"] = (jnp.repeat(attn[n], r, axis=1) for n in ("k", "v"))
    mha = scan_tree(mha_cfg, mha)
    toks = tokens()
    np.testing.assert_allclose(
        apply(CFG, params, toks).logits, apply(mha_cfg, mha, toks).logits, atol=1e-5
    )


def test_bf16_compute_with_fp32_params_is_close_to_fp32():
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(abstract_params(bf16))} == {jnp.dtype(jnp.float32)}
    # weights 10x the init scale, so the logits are O(1) and bf16 rounding shows
    flat = unscan_tree(nn.unbox(params_for(CFG)), CFG.num_layers)  # norm scales are 1-D here
    params = scan_tree(CFG, jax.tree.map(lambda x: x if x.ndim == 1 else 10 * x, flat))
    out = apply(bf16, params, tokens(), hidden_layers=(0,))
    assert out.logits.dtype == jnp.float32 and out.hidden[0].dtype == jnp.bfloat16
    ref = apply(CFG, params, tokens()).logits
    scale = float(np.abs(ref).max())
    assert scale > 1.0
    np.testing.assert_allclose(out.logits, ref, atol=0.05 * scale)


def test_hidden_layers():
    params, toks = params_for(CFG), tokens()
    out = apply(CFG, params, toks, hidden_layers=(-1, 0, 1))
    assert sorted(out.hidden) == [-1, 0, 1]
    assert all(h.shape == (B, T, CFG.d_model) for h in out.hidden.values())
    emb = nn.unbox(params)["embed"]["embedding"][toks]
    np.testing.assert_allclose(out.hidden[-1], emb)
    np.testing.assert_allclose(out.logits, apply(CFG, params, toks).logits, atol=1e-6)
    with pytest.raises(ValueError, match="out of range"):
        apply(CFG, params, toks, hidden_layers=(2,))


def test_tied_vs_untied_param_count():
    untied = dataclasses.replace(CFG, tie_embeddings=False)
    n_tied, n_untied = count_params(params_for(CFG)), count_params(abstract_params(untied))
    assert n_untied - n_tied == CFG.vocab_size * CFG.d_model
    assert nn.unbox(abstract_params(untied))["head"].shape == (CFG.d_model, CFG.vocab_size)
    d, h, g, k, f = 32, 4, 2, 8, 64
    per_layer = d * h * k * 2 + 2 * d * g * k + 3 * d * f + 2 * d
    assert n_tied == CFG.vocab_size * d + CFG.num_layers * per_layer + d


def test_remat_gives_same_values_and_grads():
    rcfg = dataclasses.replace(CFG, remat_policy="full")
    params, toks = nn.unbox(params_for(CFG)), tokens()
    loss = lambda c: jax.jit(jax.value_and_grad(lambda p: apply_eager(c, p, toks).logits.std()))(
        params
    )
    (v0, g0), (v1, g1) = loss(CFG), loss(rcfg)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0, g1)


def test_sharded_forward_matches_unsharded():
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    boxed = params_for(CFG)
    params = jax.device_put(nn.unbox(boxed), sharding.tree_shardings(mesh, boxed))
    toks = jax.device_put(tokens(shape=(4, T)), sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh), sharding.axis_rules():
        got = jax.jit(lambda p, x: apply_eager(CFG, p, x).logits)(params, toks)
    np.testing.assert_allclose(
        got, apply(CFG, nn.unbox(boxed), tokens(shape=(4, T))).logits, atol=1e-5
    )


def test_model_flops_per_token_formula():
    cfg = get_config("tiny").model
    d, h, g, k, f, v, n = 64, 4, 2, 16, 192, 512, 2
    n_matmul = n * (2 * d * h * k + 2 * d * g * k + 3 * d * f) + d * v
    assert model_flops_per_token(cfg, 64) == 6 * n_matmul + 12 * n * h * k * 64
