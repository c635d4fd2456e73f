"""mHC inside the backbone: n = 1 pinned equals the plain model, n = 4 with Engram, caching."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.decode import decode_step, prefill
from v41jax.engram import EngramConfig, ngram_hash_ids_np
from v41jax.mhc import MHCConfig
from v41jax.model import Transformer, engram_ids_key, scan_tree, unscan_tree

BASE = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32
)
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 64)


def _init(cfg, extras=None):
    return nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), TOKENS, extras=extras))["params"]


def test_n1_with_gates_pinned_to_one_is_the_plain_model():
    # per-block views of both trees (the blocks run as scanned runs)
    plain = unscan_tree(_init(BASE), BASE.num_layers)
    cfg = dataclasses.replace(BASE, mhc=MHCConfig(n_streams=1))
    params = unscan_tree(_init(cfg), BASE.num_layers)
    for name in plain:  # share every backbone weight
        if name.startswith("block_"):
            for sub, value in plain[name].items():
                params[name][sub] = value
        else:
            params[name] = plain[name]
    for i in range(BASE.num_layers):
        for mix in ("attn_mix", "ffn_mix"):
            p = params[f"block_{i}"][mix]
            # alpha = 0: no input dependence; bias [pre | post | res]: sigmoid(30) == 1.0 in
            # fp32, 2 * sigmoid(0) == 1; H_res of a 1x1 is exactly 1.
            p["alpha"] = jnp.zeros_like(p["alpha"])
            p["bias"] = jnp.array([30.0, 0.0, 0.0], jnp.float32)
    want = Transformer(BASE).apply({"params": scan_tree(BASE, plain)}, TOKENS).logits
    got = Transformer(cfg).apply({"params": scan_tree(cfg, params)}, TOKENS).logits
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_n4_streams_with_engram_branches_and_kv_cache():
    engram = EngramConfig(
        engram_vocab_size=(101, 103),
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(1,),
        compressed_vocab_size=64,
        table_row_align=8,
    )
    cfg = dataclasses.replace(BASE, mhc=MHCConfig(n_streams=4), engram=engram)
    identity = np.arange(64, dtype=np.int32)  # compression table: ids map to themselves
    extras = {engram_ids_key(1): jnp.asarray(ngram_hash_ids_np(np.asarray(TOKENS), 1, engram))}
    params = _init(cfg, extras)
    assert params["block_1"]["engram"]["w_k"].shape[1] == 4  # one key branch per stream
    assert params["block_0"]["attn_mix"]["phi"].shape == (4 * 32, 4 * 4 + 2 * 4)
    full = Transformer(cfg).apply({"params": params}, TOKENS, extras=extras).logits
    lengths = np.array([3, 6])
    logits, state = prefill(params, cfg, TOKENS[:, :6], jnp.asarray(lengths), identity)
    np.testing.assert_allclose(logits, full[np.arange(2), lengths - 1], atol=3e-5)
    pos = lengths.copy()
    for _ in range(4):
        tok = TOKENS[np.arange(2), pos]
        logits, state = decode_step(params, cfg, tok, state, jnp.asarray(pos), identity)
        np.testing.assert_allclose(logits, full[np.arange(2), pos], atol=3e-5)
        pos += 1


def test_training_logs_composite_gain(tmp_path):
    import json

    from v41jax import config as config_lib
    from v41jax.train import train

    for residual in ("mhc", "hc"):
        cfg = config_lib.override(
            config_lib.get_config("tiny"),
            [
                "train.steps=3",
                "train.log_every=1",
                "train.eval_every=0",
                "mesh.data=1",
                "model.mhc.n_streams=4",
                f"model.mhc.residual={residual}",
            ],
        )
        train(cfg, str(tmp_path / residual), progress=False)
        with open(tmp_path / residual / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f if '"loss"' in line]
        assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
        gains = [r["mhc_forward_gain"] for r in rows] + [r["mhc_backward_gain"] for r in rows]
        if residual == "mhc":  # doubly stochastic: the composite map cannot amplify
            assert max(gains) <= 1.0 + 1e-2
        else:
            assert all(np.isfinite(gains))
