"""Packed rows (`v41jax.model.attention.PackedRows`, the ragged verify engine's forward): N
tokens of a KV cache's B rows on one axis give the same logits, hidden states and cache
entries as a [B, T] call on each row's own tokens, for scanned and unscanned layers, mHC,
MoE (dropless) and GQA; rows with no tokens and padding tokens write nothing; features that
mix tokens across the packed axis are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.config import EngramConfig, MHCConfig, ModelConfig, MoEConfig
from v41jax.decode.generate import init_cache
from v41jax.model import Transformer, init_params
from v41jax.model.attention import pack_rows

BASE = ModelConfig(
    vocab_size=32,
    d_model=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    d_ff=48,
    max_seq_len=24,
    init_std=0.3,
)
CASES = {
    "scanned": BASE,
    "unscanned": dataclasses.replace(BASE, scan_layers=False),
    "mhc_single_pass": dataclasses.replace(BASE, mhc=MHCConfig(n_streams=2, form="single_pass")),
    "moe_dropless": dataclasses.replace(BASE, moe=MoEConfig(num_experts=4, top_k=2)),
}


def _prefilled(cfg, params, b, seed):
    rng = np.random.default_rng(seed)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 7)), jnp.int32)
    start = jnp.zeros((b,), jnp.int32)
    return (
        Transformer(cfg)
        .apply({"params": params}, toks, cache=init_cache(cfg, b), cache_index=start)
        .cache
    )


@pytest.mark.parametrize(
    "name, counts",
    [(name, (2, 0, 4, 1, 3)) for name in sorted(CASES)]
    + [("scanned", (5, 5, 5, 5, 5)), ("scanned", (0, 0, 1, 0, 0))],
)
def test_packed_rows_equal_each_rows_own_call(name, counts):
    cfg = CASES[name]
    params = nn.unbox(init_params(cfg, jax.random.key(1)))
    b, w = len(counts), 5
    cache = _prefilled(cfg, params, b, seed=2)
    rng = np.random.default_rng(3)
    start = np.array([7, 3, 5, 6, 4], np.int32)  # where each row's new tokens go
    new = rng.integers(0, cfg.vocab_size, (b, w)).astype(np.int32)
    n = sum(counts) + 3  # three padding tokens
    packed = pack_rows(jnp.asarray(counts), jnp.asarray(start), n, w)
    flat = np.concatenate([new[r, :c] for r, c in enumerate(counts)] + [np.zeros(3, np.int32)])
    got = Transformer(cfg).apply(
        {"params": params}, jnp.asarray(flat)[None], cache=cache, packed=packed, hidden_layers=(1,)
    )
    assert got.logits.shape == (1, n, cfg.vocab_size)
    offset = 0
    for r, c in enumerate(counts):
        one = lambda x, r=r: jax.tree.map(lambda a: a[..., r : r + 1, :, :, :], x)  # noqa: E731
        ref = Transformer(
            cfg
        ).apply(
            {"params": params},
            jnp.asarray(new[r : r + 1]),  # all W tokens: one compile for every row
            cache=one(cache),
            cache_index=jnp.asarray(start[r : r + 1]),
            hidden_layers=(1,),
        )
        np.testing.assert_allclose(got.logits[0, offset : offset + c], ref.logits[0, :c], atol=2e-5)
        np.testing.assert_allclose(
            got.hidden[1][0, offset : offset + c], ref.hidden[1][0, :c], atol=2e-5
        )
        for seg in cache:
            for kv in ("k", "v"):
                g, want, old = got.cache[seg][kv], ref.cache[seg][kv], cache[seg][kv]
                # the row's new slots hold its own entries; every other slot is untouched
                sl = slice(int(start[r]), int(start[r]) + c)
                np.testing.assert_allclose(g[..., r, sl, :, :], want[..., 0, sl, :, :], atol=2e-5)
                mask = np.ones(cfg.max_seq_len, bool)
                mask[sl] = False
                np.testing.assert_array_equal(g[..., r, mask, :, :], old[..., r, mask, :, :])
        offset += c


def test_pack_rows_indexes_rows_in_order_and_marks_padding():
    p = pack_rows(jnp.array([2, 0, 3]), jnp.array([4, 9, 1]), 7, 4)
    assert p.row_N.tolist() == [0, 0, 2, 2, 2, 3, 3]  # B = 3 marks padding
    assert p.slot_N.tolist()[:5] == [4, 5, 1, 2, 3]
    assert p.index_BxW.tolist() == [[0, 1, 7, 7], [7, 7, 7, 7], [2, 3, 4, 7]]
    x = jnp.arange(7.0)[:, None]
    rows = p.to_rows(x)
    assert rows[..., 0].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [2, 3, 4, 0]]
    np.testing.assert_array_equal(p.from_rows(rows)[:5], x[:5])


def test_features_that_mix_packed_tokens_are_refused():
    eng = EngramConfig(
        engram_vocab_size=(31, 37),
        max_ngram_size=3,
        n_embed_per_ngram=8,
        n_head_per_ngram=2,
        layer_ids=(0,),
        compressed_vocab_size=32,
        use_short_conv=True,
    )
    packed = pack_rows(jnp.array([1, 1]), jnp.array([0, 0]), 2, 2)
    for cfg, match in (
        (dataclasses.replace(BASE, engram=eng), "short conv"),
        (
            dataclasses.replace(BASE, moe=MoEConfig(num_experts=4, capacity_factor=1.0)),
            "capacity_factor=1.0",
        ),
    ):
        params = nn.unbox(init_params(cfg, jax.random.key(0)))
        with pytest.raises(ValueError, match=match):
            Transformer(cfg).apply(
                {"params": params},
                jnp.zeros((1, 2), jnp.int32),
                cache=init_cache(cfg, 2),
                packed=packed,
            )
    params = nn.unbox(init_params(BASE, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"\[1, N=2\]"):
        Transformer(BASE).apply(
            {"params": params},
            jnp.zeros((2, 1), jnp.int32),
            cache=init_cache(BASE, 2),
            packed=packed,
        )
    with pytest.raises(ValueError, match="need a KV cache"):
        Transformer(BASE).apply({"params": params}, jnp.zeros((1, 2), jnp.int32), packed=packed)
