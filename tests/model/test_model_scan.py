"""Scanned layer runs equal the unscanned blocks: forward logits, hidden taps, gradients
(mapped through the layout conversion), greedy and sampled KV-cache generation, for a plain
stack, Engram + MoE + mHC single_pass, and mHC "fused"; every remat policy gives the values
and gradients of "none"; layout conversion of param and optimizer trees."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from v41jax.config import REMAT_POLICIES, EngramConfig, MHCConfig, ModelConfig, MoEConfig
from v41jax.decode import SamplingParams, generate, init_cache
from v41jax.engram import ngram_hash_ids_np
from v41jax.model import (
    Transformer,
    convert_layout,
    engram_ids_key,
    init_params,
    layer_segments,
    scan_tree,
    unscan_tree,
)

BASE = ModelConfig(
    vocab_size=64, d_model=32, num_layers=5, num_heads=4, num_kv_heads=2, d_ff=48, max_seq_len=32
)
ENGRAM = EngramConfig(
    engram_vocab_size=(101, 103),
    max_ngram_size=3,
    n_embed_per_ngram=16,
    n_head_per_ngram=2,
    layer_ids=(1,),
    compressed_vocab_size=64,
    table_row_align=8,
)
MIXED = dataclasses.replace(
    BASE,
    num_layers=6,
    engram=ENGRAM,
    moe=MoEConfig(num_experts=4, top_k=2, d_expert=16, layer_ids=(2, 3)),
    mhc=MHCConfig(n_streams=2, form="single_pass"),
)
FUSED = dataclasses.replace(BASE, num_layers=4, mhc=MHCConfig(n_streams=2, form="fused"))
CONFIGS = {"plain": BASE, "mixed": MIXED, "fused": FUSED}
TOKENS = jax.random.randint(jax.random.key(1), (2, 9), 0, 64, dtype=jnp.int32)
IDENTITY = np.arange(64, dtype=np.int32)  # compression table: ids map to themselves


def _extras(cfg, tokens=TOKENS):
    return {
        engram_ids_key(i): jnp.asarray(ngram_hash_ids_np(np.asarray(tokens), i, cfg.engram))
        for i in (cfg.engram.layer_ids if cfg.engram.enabled else ())
    }


def _flat(cfg):
    return dataclasses.replace(cfg, scan_layers=False)


@functools.cache
def _params(name):
    """(unscanned params, the same values in the scanned layout), perturbed off init."""
    cfg = CONFIGS[name]

    @jax.jit
    def perturbed(key):
        flat = nn.unbox(init_params(_flat(cfg), key))
        leaves, tree = jax.tree.flatten(flat)
        keys = jax.random.split(jax.random.key(7), len(leaves))
        noise = [0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
        return tree.unflatten([x + n for x, n in zip(leaves, noise, strict=True)])

    flat = perturbed(jax.random.key(0))
    return flat, jax.jit(functools.partial(scan_tree, cfg))(flat)


@functools.partial(jax.jit, static_argnames=("cfg", "taps"))
def _loss_and_grad(cfg, params, taps=(-1, 0, 3)):
    def loss(p):
        out = Transformer(cfg).apply({"params": p}, TOKENS, extras=_extras(cfg), hidden_layers=taps)
        return jnp.mean(jnp.sin(out.logits)), (out.logits, out.hidden)

    return jax.value_and_grad(loss, has_aux=True)(params)


def test_segments_split_at_engram_moe_and_single_pass_layer_0():
    assert [s.name for s in layer_segments(BASE)] == ["layers_0_4"]
    assert [s.name for s in layer_segments(MIXED)] == [
        "block_0",
        "block_1",
        "layers_2_3",
        "layers_4_5",
    ]
    assert [s.ffn_kind for s in layer_segments(MIXED)][2:] == ["moe", "dense"]
    assert [s.name for s in layer_segments(_flat(MIXED))] == [f"block_{i}" for i in range(6)]
    shapes = jax.tree.map(jnp.shape, _params("mixed")[1])
    assert shapes["layers_2_3"]["ffn"]["w_gate"] == (2, 4, 32, 16)
    boxed = jax.eval_shape(functools.partial(init_params, MIXED), jax.random.key(0))
    assert boxed["layers_4_5"]["attn"]["q"].names == ("layers", "embed", "heads", "head_dim")


# Slow: "plain" (one scanned run of dense layers; "mixed" has two such runs besides its blocks).
@pytest.mark.parametrize("name", [pytest.param("plain", marks=pytest.mark.slow), "fused", "mixed"])
def test_scanned_equals_unscanned_values_taps_and_grads(name):
    cfg = CONFIGS[name]
    flat, scanned = _params(name)
    (v0, (logits0, hid0)), g0 = _loss_and_grad(_flat(cfg), flat)
    (v1, (logits1, hid1)), g1 = _loss_and_grad(cfg, scanned)
    np.testing.assert_allclose(logits1, logits0, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    assert sorted(hid1) == [-1, 0, 3]
    for i in hid0:
        np.testing.assert_allclose(hid1[i], hid0[i], atol=2e-5, rtol=1e-5)
    g1 = unscan_tree(g1, cfg.num_layers)
    assert jax.tree.structure(g1) == jax.tree.structure(g0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6 + 1e-4 * float(jnp.abs(b).max()), rtol=1e-4)


@pytest.mark.parametrize("name", ["plain", "mixed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scanned_generation_equals_unscanned(name, temperature):
    cfg = CONFIGS[name]
    flat, scanned = _params(name)
    prompts = np.asarray(TOKENS[:, :6])
    lengths = np.array([3, 6], np.int32)
    kw = dict(max_new_tokens=8, sampling=SamplingParams(temperature), rng=jax.random.key(3))
    kw["compression"] = IDENTITY if cfg.engram.enabled else None
    want = generate(flat, _flat(cfg), prompts, lengths, **kw)
    got = generate(scanned, cfg, prompts, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cached_forward_writes_only_its_slots_of_the_stacked_cache():
    cfg = BASE
    _, scanned = _params("plain")
    cache = jax.tree.map(lambda x: x + 7.0, init_cache(cfg, 2))  # a marker in every slot
    start = jnp.array([2, 5], jnp.int32)
    out = Transformer(cfg).apply({"params": scanned}, TOKENS[:, :3], cache=cache, cache_index=start)
    k = np.asarray(out.cache["layers_0_4"]["k"])  # [L, B, S, G, K]
    assert k.shape == (5, 2, cfg.max_seq_len, cfg.num_kv_heads, 8)
    for b, s in enumerate([2, 5]):
        written = np.zeros(cfg.max_seq_len, bool)
        written[s : s + 3] = True
        assert np.all(k[:, b, ~written] == 7.0)
        assert np.all(k[:, b, written] != 7.0)


# Fast: "save_qkv_proj" (a policy by checkpoint names; test_model_remat.py checks what it
# saves); "full" keeps the values and grads in test_model_transformer.py, fast. The others
# (each a compile of the remat gradient, minutes on a loaded 2-core machine) are slow.
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(p, marks=() if p == "save_qkv_proj" else pytest.mark.slow)
        for p in REMAT_POLICIES
        if p != "none"
    ],
)
def test_every_remat_policy_gives_the_values_and_grads_of_none(policy):
    # mHC "fused": one scanned run (remat inside the scan body); the unscanned blocks'
    # remat is exercised by tests/mhc/test_mhc_forms.py (single_pass + Engram)
    _, scanned = _params("fused")
    (v0, (logits0, _)), g0 = _loss_and_grad(FUSED, scanned)
    rcfg = dataclasses.replace(FUSED, remat_policy=policy)
    (v1, (logits1, _)), g1 = _loss_and_grad(rcfg, scanned)
    np.testing.assert_allclose(logits1, logits0, atol=1e-6)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_layout_conversion_round_trips_params_and_adam_state():
    flat, scanned = _params("mixed")
    back = unscan_tree(scanned, MIXED.num_layers)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(flat), strict=True):
        np.testing.assert_array_equal(a, b)
    adam = optax.adamw(1e-3)
    opt_flat = adam.init(flat)
    opt_scanned = scan_tree(MIXED, opt_flat)
    assert jax.tree.structure(opt_scanned) == jax.tree.structure(adam.init(scanned))
    np.testing.assert_array_equal(
        opt_scanned[0].mu["layers_4_5"]["attn"]["q"][1], opt_flat[0].mu["block_5"]["attn"]["q"]
    )
    with pytest.raises(ValueError, match=r"layers_2_3 needs layers 2..3, the tree has \[2\]"):
        convert_layout({k: v for k, v in flat.items() if k != "block_3"}, layer_segments(MIXED))
    with pytest.raises(ValueError, match="keyed by the model's segments"):
        Transformer(MIXED).apply(
            {"params": scanned}, TOKENS[:, :1], cache=init_cache(_flat(MIXED), 2)
        )
