"""Engram layer: the gate against a hand-written NumPy reference (arXiv 2601.07372), the fused
multi-branch keys, the short conv, fp8/bf16 tables, sparse table gradients, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.engram import fp8
from v41jax.engram.config import EngramConfig
from v41jax.engram.layer import (
    Engram,
    engram_forward,
    engram_gate_value,
    export_fp8_table,
    short_conv,
)
from v41jax.engram.primes import layer_primes, stored_table_rows

CFG = EngramConfig(
    engram_vocab_size=(101, 103),
    max_ngram_size=3,
    n_embed_per_ngram=16,
    n_head_per_ngram=2,
    layer_ids=(0, 2),
    compressed_vocab_size=50,
)
D = 7  # odd on purpose: nothing may assume an even width
B, T = 2, 11


# ----------------------------------------------------------------------------- helpers


def np_rms_norm(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def np_gate_value(p, h_btmd, e_bte, eps=1e-6):
    """The Engram layer (arXiv 2601.07372) written out branch by branch, in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    e = np.asarray(e_bte, np.float64)
    d = h_btmd.shape[-1]
    value = e @ p["w_v"] + p["b_v"]
    out = []
    for m in range(h_btmd.shape[2]):
        k = np_rms_norm(e @ p["w_k"][:, m, :] + p["b_k"][m], p["key_norm"][m], eps)
        q = np_rms_norm(h_btmd[:, :, m], p["query_norm"][m], eps)
        s = (k * q).sum(-1) / np.sqrt(d)
        s = np.sign(s) * np.sqrt(np.maximum(np.abs(s), 1e-6))
        out.append(value / (1 + np.exp(-s))[..., None])
    return np.stack(out, axis=2)


def np_short_conv(p, v, kernel_size, dilation, eps=1e-5):
    x = np_rms_norm(v, np.asarray(p["conv_norm"], np.float64), eps)
    w = np.asarray(p["conv_kernel"], np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(kernel_size):
            src = t - (kernel_size - 1 - j) * dilation
            if src >= 0:
                y[:, t] += w[j] * x[:, src]
    return v + y / (1 + np.exp(-y))


def random_params(seed, cfg, d, m, conv=False):
    """Random (not init-like) params so every term of the gate matters; NumPy RNG is cheap."""
    rng = np.random.default_rng(seed)
    e = cfg.embed_dim
    n = lambda shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)
    p = {
        "w_v": n((e, d), e**-0.5),
        "b_v": n((d,), 0.1),
        "w_k": n((e, m, d), e**-0.5),
        "b_k": n((m, d), 0.1),
        "key_norm": 1 + n((m, d), 0.2),
        "query_norm": 1 + n((m, d), 0.2),
    }
    if conv:
        p["conv_norm"] = 1 + n((m, d), 0.2)
        p["conv_kernel"] = n((cfg.kernel_size, m, d), 0.5)
    return p


def normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_hash_ids(seed, cfg, layer_id, b=B, t=T):
    primes = np.asarray(layer_primes(cfg, layer_id))
    ids = np.random.default_rng(seed).integers(0, primes, size=(b, t, len(primes)))
    return jnp.asarray(ids, jnp.int32)


conv_jit = jax.jit(short_conv, static_argnums=(2, 3))


def run(module, params, h, ids):
    return jax.jit(module.apply)({"params": params}, h, ids)


def init_apply(module, h, ids):
    variables = jax.jit(module.init)(jax.random.key(0), h, ids)
    return nn.unbox(variables)["params"], variables


# ----------------------------------------------------------------------------- pure cores


@pytest.mark.parametrize("m", [1, 3])
def test_gate_value_matches_numpy_reference(m):
    p = random_params(m, CFG, D, m)
    h, e = normal(10 + m, B, T, m, D), normal(20 + m, B, T, CFG.embed_dim)
    got = jax.jit(engram_gate_value)(p, h, e)
    assert got.shape == (B, T, m, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_gate_value(p, np.asarray(h), e), rtol=2e-5, atol=2e-6)


def test_fused_keys_equal_separate_branches():
    m = 4
    p = random_params(7, CFG, D, m)
    h, e = normal(8, B, T, m, D), normal(9, B, T, CFG.embed_dim)
    fused = jax.jit(engram_gate_value)(p, h, e)
    for i in range(m):
        # branch i alone: its own [E, 1, D] key matmul and norms, the shared W_V
        branch = {**p, "w_k": p["w_k"][:, i : i + 1]}
        branch |= {k: p[k][i : i + 1] for k in ("b_k", "key_norm", "query_norm")}
        one = jax.jit(engram_gate_value)(branch, h[:, :, i : i + 1], e)
        np.testing.assert_allclose(fused[:, :, i : i + 1], one, rtol=1e-5, atol=1e-6)


def test_signed_sqrt_floor_gives_half_gate_at_zero_score():
    p = random_params(0, CFG, D, 1)
    h = jnp.zeros((1, 1, 1, D))  # q = 0 -> s = 0 -> sign 0 -> alpha = 1/2
    e = normal(1, 1, 1, CFG.embed_dim)
    value = e @ p["w_v"] + p["b_v"]
    np.testing.assert_allclose(engram_gate_value(p, h, e)[:, :, 0], 0.5 * value, rtol=1e-6)


@pytest.mark.parametrize("m", [1, 2])
def test_short_conv_matches_numpy_dilated_conv(m):
    p = random_params(3, CFG, D, m, conv=True)
    v = normal(4, B, 13, m, D)
    got = conv_jit(p, v, CFG.kernel_size, CFG.max_ngram_size)
    want = np_short_conv(p, np.asarray(v, np.float64), CFG.kernel_size, CFG.max_ngram_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_short_conv_is_identity_with_zero_kernel():
    p = random_params(3, CFG, D, 2, conv=True)
    p["conv_kernel"] = jnp.zeros_like(p["conv_kernel"])
    v = normal(4, B, T, 2, D)
    np.testing.assert_array_equal(conv_jit(p, v, CFG.kernel_size, 3), v)


def test_short_conv_is_causal_with_dilated_taps():
    k, dil, t = CFG.kernel_size, CFG.max_ngram_size, 16
    p = random_params(5, CFG, D, 1, conv=True)
    v = normal(6, 1, t, 1, D)
    for out_t in (0, 7, t - 1):
        f = lambda x, out_t=out_t: short_conv(p, x, k, dil)[0, out_t].sum()
        reach = np.abs(np.asarray(jax.jit(jax.grad(f))(v))[0, :, 0]).sum(-1)
        seen = {out_t - j * dil for j in range(k) if out_t - j * dil >= 0}
        assert set(np.nonzero(reach)[0]) == seen, (out_t, np.nonzero(reach)[0])


def test_short_conv_rejects_wrong_tap_count():
    p = random_params(5, CFG, D, 1, conv=True)
    with pytest.raises(ValueError, match="taps"):
        short_conv(p, jnp.zeros((1, 4, 1, D)), 3, 3)


# ----------------------------------------------------------------------------- module


def test_module_equals_numpy_gather_with_head_offsets():
    layer = 2
    h = normal(1, B, T, D)
    ids = random_hash_ids(2, CFG, layer)
    params, _ = init_apply(Engram(CFG, layer, D), h, ids)
    primes = np.asarray(layer_primes(CFG, layer))
    offsets = np.concatenate([[0], np.cumsum(primes)[:-1]])
    # sum of primes, rounded up to table_row_align (padding rows are never addressed)
    align = CFG.table_row_align
    assert params["table"].shape == (-(-primes.sum() // align) * align, CFG.head_dim)
    rows = np.asarray(params["table"])[np.asarray(ids) + offsets]  # [B, T, H, K]
    e = rows.reshape(B, T, CFG.embed_dim)
    want = np_gate_value(params, np.asarray(h)[:, :, None], e)[:, :, 0]
    got = Engram(CFG, layer, D).apply({"params": params}, h, ids)  # eager
    assert got.shape == (B, T, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    jitted = run(Engram(CFG, layer, D), params, h, ids)
    np.testing.assert_allclose(jitted, got, rtol=1e-6, atol=1e-7)


def test_plain_input_equals_single_branch():
    h = normal(1, B, T, D)
    ids = random_hash_ids(2, CFG, 0)
    mod = Engram(CFG, 0, D, num_branches=1)
    params, _ = init_apply(mod, h, ids)
    plain = run(mod, params, h, ids)
    branched = run(mod, params, h[:, :, None], ids)
    assert branched.shape == (B, T, 1, D)
    np.testing.assert_array_equal(plain, branched[:, :, 0])


@pytest.mark.parametrize("m", [1, 4])
def test_params_have_shapes_and_logical_axes(m):
    cfg = dataclasses.replace(CFG, use_short_conv=True)
    h = jnp.zeros((B, T, m, D))
    ids = random_hash_ids(0, cfg, 0)
    variables = jax.eval_shape(Engram(cfg, 0, D, num_branches=m).init, jax.random.key(0), h, ids)
    boxed = variables["params"]
    e = cfg.embed_dim
    shapes = {k: v.value.shape for k, v in boxed.items()}
    assert shapes == {
        "table": (stored_table_rows(cfg, 0), cfg.head_dim),  # sum of primes, aligned
        "w_v": (e, D),
        "b_v": (D,),
        "w_k": (e, m, D),
        "b_k": (m, D),
        "key_norm": (m, D),
        "query_norm": (m, D),
        "conv_norm": (m, D),
        "conv_kernel": (cfg.kernel_size, m, D),
    }
    for name, leaf in boxed.items():
        assert isinstance(leaf, nn.LogicallyPartitioned), name
        assert len(leaf.names) == leaf.value.ndim and all(leaf.names), name
    assert boxed["table"].names == ("engram_rows", "engram_head_dim")


def test_init_scales_and_zero_conv_is_identity():
    cfg = dataclasses.replace(CFG, use_short_conv=True)
    h = normal(1, B, T, 2, D)
    ids = random_hash_ids(2, cfg, 0)
    params, _ = init_apply(Engram(cfg, 0, D, num_branches=2, init_std=0.02), h, ids)
    assert np.std(params["table"]) == pytest.approx(0.02, rel=0.1)
    assert not np.any(params["conv_kernel"]) and not np.any(params["b_k"])
    with_conv = run(Engram(cfg, 0, D, num_branches=2), params, h, ids)
    no_conv_params = {k: v for k, v in params.items() if not k.startswith("conv")}
    cfg_off = dataclasses.replace(cfg, use_short_conv=False)
    no_conv = run(Engram(cfg_off, 0, D, num_branches=2), no_conv_params, h, ids)
    np.testing.assert_array_equal(with_conv, no_conv)


def test_bf16_compute_and_bf16_table_storage():
    cfg = dataclasses.replace(CFG, table_dtype="bfloat16")
    h = normal(1, B, T, 3, D)
    ids = random_hash_ids(2, cfg, 0)
    mod = Engram(cfg, 0, D, num_branches=3, dtype=jnp.bfloat16)
    params, _ = init_apply(mod, h, ids)
    assert params["table"].dtype == jnp.bfloat16 and params["w_v"].dtype == jnp.float32
    out = run(mod, params, h, ids)
    assert out.shape == (B, T, 3, D) and out.dtype == jnp.bfloat16
    f32_table = {**params, "table": params["table"].astype(jnp.float32)}
    ref = run(Engram(CFG, 0, D, num_branches=3), f32_table, h, ids)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=5e-2, atol=5e-3)


def test_fp8_master_forward_equals_exported_fp8_table():
    cfg = dataclasses.replace(CFG, table_dtype="float8_e4m3fn")
    h = normal(1, B, T, D)
    ids = random_hash_ids(2, cfg, 2)
    mod = Engram(cfg, 2, D)
    params, _ = init_apply(mod, h, ids)
    assert params["table"].dtype == jnp.float32  # the training master
    trained = run(mod, params, h, ids)
    exported = export_fp8_table(params)
    assert exported["table"].dtype == jnp.float8_e4m3fn
    served = engram_forward(exported, h, ids, cfg, 2)
    np.testing.assert_allclose(trained, served, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(run(mod, exported, h, ids), served, rtol=1e-6, atol=1e-7)
    # and it really is quantised: the fp32-table forward differs
    exact = run(Engram(CFG, 2, D), params, h, ids)
    assert not np.allclose(trained, exact, rtol=1e-6, atol=1e-7)
    dequant = fp8.dequantize_rows(exported["table"], exported["table_scale"])
    np.testing.assert_allclose(dequant, params["table"], rtol=0.07, atol=1e-6)


def test_fp8_table_without_scale_is_rejected():
    cfg = dataclasses.replace(CFG, table_dtype="float8_e4m3fn")
    h = jnp.zeros((B, T, D))
    ids = random_hash_ids(2, cfg, 0)
    params, _ = init_apply(Engram(cfg, 0, D), h, ids)
    params["table"] = params["table"].astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="table_scale"):
        engram_forward(params, h, ids, cfg, 0)


@pytest.mark.parametrize("table_dtype", ["float32", "float8_e4m3fn"])
def test_table_gradient_only_at_addressed_rows(table_dtype):
    cfg = dataclasses.replace(CFG, table_dtype=table_dtype, use_short_conv=True)
    h = normal(1, B, T, 2, D)
    ids = random_hash_ids(2, cfg, 0, t=5)
    h = h[:, :5]
    mod = Engram(cfg, 0, D, num_branches=2)
    params, _ = init_apply(mod, h, ids)
    params["conv_kernel"] = 0.3 * jnp.ones_like(params["conv_kernel"])
    loss = lambda p: jnp.sum(run(mod, p, h, ids) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    offsets = np.concatenate([[0], np.cumsum(layer_primes(cfg, 0))[:-1]])
    hit = np.zeros(params["table"].shape[0], bool)
    hit[(np.asarray(ids) + offsets).ravel()] = True
    row_norm = np.abs(np.asarray(grads["table"])).sum(-1)
    assert np.all(row_norm[~hit] == 0.0)
    assert np.all(row_norm[hit] > 0.0)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_clear_errors_on_bad_inputs():
    h = jnp.zeros((B, T, D))
    ids = random_hash_ids(0, CFG, 0)
    mod = Engram(CFG, 0, D)
    params, _ = init_apply(mod, h, ids)
    with pytest.raises(ValueError, match=r"\[B, T, D\]"):
        run(mod, params, jnp.zeros((B * T, D)), ids)
    with pytest.raises(ValueError, match=r"\[B, T, 2, 7\]"):
        Engram(CFG, 0, D, num_branches=2).init(jax.random.key(0), h, ids)
    with pytest.raises(ValueError, match="hash ids"):
        run(mod, params, h, ids[..., :3])
    with pytest.raises(ValueError, match="layer_ids"):
        Engram(CFG, 1, D).init(jax.random.key(0), h, ids)
    with pytest.raises(ValueError, match="layer_ids"):
        engram_forward(params, h, ids, CFG, 5)
    with pytest.raises(ValueError, match="integers"):
        engram_forward(params, h, ids.astype(jnp.float32), CFG, 0)
    # layer 2 has other primes (unaligned, so the table shapes differ)
    exact = dataclasses.replace(CFG, table_row_align=1)
    params, _ = init_apply(Engram(exact, 0, D), h, ids)
    with pytest.raises(ValueError, match="another EngramConfig"):
        engram_forward(params, h, random_hash_ids(0, exact, 2), exact, 2)


def test_custom_lookup_is_used():
    h = normal(1, B, T, D)
    ids = random_hash_ids(2, CFG, 0)
    params, _ = init_apply(Engram(CFG, 0, D), h, ids)
    calls = []

    def take(table, flat_ids, row_scale):
        calls.append(flat_ids.shape)
        assert row_scale is None
        return jnp.take(table, flat_ids, axis=0).reshape(*flat_ids.shape[:2], -1)

    got = engram_forward(params, h, ids, CFG, 0, lookup=take)
    np.testing.assert_allclose(got, run(Engram(CFG, 0, D), params, h, ids), rtol=1e-5, atol=1e-7)
    assert calls == [(B, T, CFG.num_heads_total)]


def test_row_sharded_padded_table_lookup_matches():
    from jax.sharding import NamedSharding, PartitionSpec

    from v41jax.config import MeshConfig
    from v41jax.engram.sharded import pad_table, sharded_lookup
    from v41jax.sharding import make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    h = normal(1, 4, T, D)
    ids = random_hash_ids(2, CFG, 0, b=4)
    params, _ = init_apply(Engram(CFG, 0, D), h, ids)
    padded = pad_table(params["table"], 8)
    padded = jax.device_put(padded, NamedSharding(mesh, PartitionSpec(("data", "fsdp", "tensor"))))
    lookup = lambda table, flat_ids, scale: sharded_lookup(table, flat_ids, mesh, row_scale=scale)
    fwd = jax.jit(lambda p: engram_forward(p, h, ids, CFG, 0, lookup=lookup))
    got = fwd({**params, "table": padded})
    np.testing.assert_allclose(got, run(Engram(CFG, 0, D), params, h, ids), rtol=1e-5, atol=1e-7)
