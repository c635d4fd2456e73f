"""The three mHC forms in the backbone: fused == reference; single_pass == its hand-composed
lagged equations; every form keeps the KV cache, the sown H_res and training working."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.decode import decode_step, prefill
from v41jax.mhc import FORMS, MHCConfig, expand_streams
from v41jax.mhc.single_pass import single_pass_forward_reference
from v41jax.model import Transformer, unscan_tree
from v41jax.model.attention import AttentionLayout
from v41jax.model.layers import Embed
from v41jax.model.transformer import Block

BASE = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32
)
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 64)
WEIGHTS = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 64))


def _cfg(form, **mhc):
    return dataclasses.replace(BASE, mhc=MHCConfig(n_streams=4, form=form, **mhc))


def _init(cfg):
    return nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), TOKENS))["params"]


def _perturb(params, key=3, scale=0.3):
    """Move alpha and the norm scales off their init so every path carries signal."""
    leaves, treedef = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(key), len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        if "alpha" in name or "scale" in name:
            leaf = leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def _loss(cfg):
    return lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, TOKENS).logits * WEIGHTS)


def test_forms_listed_and_validated():
    assert FORMS == ("reference", "fused", "single_pass")
    with pytest.raises(ValueError, match="form"):
        MHCConfig(n_streams=4, form="nope")


# "hc" (the unconstrained residual: the same fused code, other mixing maps) is slow
@pytest.mark.parametrize("residual", ["mhc", pytest.param("hc", marks=pytest.mark.slow)])
def test_fused_equals_reference_logits_and_grads(residual):
    ref_cfg, fused_cfg = _cfg("reference", residual=residual), _cfg("fused", residual=residual)
    params = _perturb(_init(ref_cfg))
    assert jax.tree.structure(params) == jax.tree.structure(_init(fused_cfg))
    (want, want_g), (got, got_g) = (
        jax.value_and_grad(_loss(c))(params) for c in (ref_cfg, fused_cfg)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def _single_pass_by_hand(cfg, params):
    """Embed -> expand -> `single_pass_forward_reference` over the 4 sub-layers -> tied head."""
    embed = Embed(cfg.vocab_size, cfg.d_model)
    x0 = expand_streams(embed.apply({"params": params["embed"]}, TOKENS), cfg.mhc.n_streams)
    arange = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    layout = AttentionLayout(arange, arange)
    fns, mix_params, scales = [], [], []
    params = unscan_tree(params, cfg.num_layers)  # one "block_{i}" per layer
    for i in range(cfg.num_layers):
        p = params[f"block_{i}"]

        def run(h, p=p, i=i, f=None):
            return Block(cfg, layer_index=i).apply({"params": p}, h, method=f)

        fns.append(lambda h, run=run: run(h, f=lambda m, h: m.attn(h, arange, layout)[0]))
        fns.append(lambda h, run=run: run(h, f=lambda m, h: m.ffn(h)))
        mix_params += [p["attn_mix"], p["ffn_mix"]]
        scales += [p["attn_norm"]["scale"], p["ffn_norm"]["scale"]]
    scales.append(params["final_norm"]["scale"])
    _, h = single_pass_forward_reference(
        mix_params, x0, fns, cfg.mhc, scales, norm_eps=cfg.norm_eps
    )
    return embed.apply({"params": params["embed"]}, h, method="attend")


def test_single_pass_model_equals_hand_composed_lagged_equations():
    cfg = _cfg("single_pass")
    params = _perturb(_init(cfg))
    ref_tree = _init(_cfg("reference"))  # same param names and shapes as the reference form
    # (per block: single_pass runs layer 0 apart from the scanned run, so the runs differ)
    flat, ref_flat = (unscan_tree(t, cfg.num_layers) for t in (params, ref_tree))
    assert jax.tree.map(jnp.shape, flat) == jax.tree.map(jnp.shape, ref_flat)

    def by_hand(p):
        return jnp.sum(_single_pass_by_hand(cfg, p) * WEIGHTS)

    (want, want_g), (got, got_g) = (jax.value_and_grad(f)(params) for f in (by_hand, _loss(cfg)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    flat_w = jax.tree.leaves_with_path(want_g)
    for (path, w), g in zip(flat_w, jax.tree.leaves(got_g), strict=True):
        tol = 1e-5 * float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=tol, err_msg=jax.tree_util.keystr(path))
    # the sown H_res: two per block, in depth order, doubly stochastic
    _, state = Transformer(cfg).apply(
        {"params": params}, TOKENS, mutable=["intermediates"], hidden_layers=(0,)
    )
    sown = unscan_tree(state["intermediates"], cfg.num_layers)  # scanned runs sow stacked
    for i in range(cfg.num_layers):
        h_res = sown[f"block_{i}"]["h_res"]
        assert len(h_res) == 2 and h_res[0].shape == (2, 9, 4, 4)
        np.testing.assert_allclose(jnp.sum(h_res[1], axis=-1), 1.0, atol=1e-3)


@pytest.mark.parametrize("form", ["fused", "single_pass"])
def test_kv_cache_matches_full_forward(form):
    cfg = _cfg(form)
    params = _init(cfg)
    full = Transformer(cfg).apply({"params": params}, TOKENS).logits
    lengths = np.array([3, 5])
    logits, state = prefill(params, cfg, TOKENS[:, :5], jnp.asarray(lengths))
    np.testing.assert_allclose(logits, full[np.arange(2), lengths - 1], atol=3e-5)
    pos = lengths.copy()
    for _ in range(3):
        tok = TOKENS[np.arange(2), pos]
        logits, state = decode_step(params, cfg, tok, state, jnp.asarray(pos))
        np.testing.assert_allclose(logits, full[np.arange(2), pos], atol=3e-5)
        pos += 1


def test_single_pass_with_remat_and_engram():
    from v41jax.engram import EngramConfig, ngram_hash_ids_np
    from v41jax.model import engram_ids_key

    engram = EngramConfig(
        engram_vocab_size=(101, 103),
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(1,),
        compressed_vocab_size=64,
        table_row_align=8,
    )
    cfg = dataclasses.replace(_cfg("single_pass"), engram=engram)
    extras = {engram_ids_key(1): jnp.asarray(ngram_hash_ids_np(np.asarray(TOKENS), 1, engram))}
    params = nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), TOKENS, extras=extras))
    outs = [
        jax.grad(lambda p, c=c: jnp.sum(Transformer(c).apply(p, TOKENS, extras=extras).logits))(
            params
        )
        for c in (cfg, dataclasses.replace(cfg, remat_policy="full"))
    ]
    for g, w in zip(*map(jax.tree.leaves, outs), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_single_pass_trains_and_logs_composite_gain(tmp_path):
    from v41jax import config as config_lib
    from v41jax.train import train

    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        [
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=0",
            "mesh.data=1",
            "model.mhc.n_streams=4",
            "model.mhc.form=single_pass",
        ],
    )
    train(cfg, str(tmp_path), progress=False)
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    losses = [r["loss"] for r in rows]
    assert len(rows) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(r["mhc_forward_gain"] <= 1.0 + 1e-2 for r in rows)


def test_single_pass_impl_is_validated():
    import pytest

    from v41jax.mhc import MHCConfig

    assert MHCConfig(n_streams=4, form="single_pass", single_pass_impl="auto").enabled
    with pytest.raises(ValueError, match="single_pass_impl='triton'"):
        MHCConfig(n_streams=4, single_pass_impl="triton")
