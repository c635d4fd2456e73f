"""dspark_generate, the heavier cases (split from test_dspark_engine.py so that xdist can run
the two files at once): sampled output follows the target's exact law (G-test, with a negative
control that must fail), the contextual Markov head, Engram targets, and a measured round-cost
table feeds the scheduler."""

import dataclasses
import functools
import itertools

import jax
import numpy as np
import pytest
from scipy import stats

from v41jax.config import EngramConfig, ModelConfig
from v41jax.dspark.config import DrafterConfig
from v41jax.dspark.drafter import Drafter, frozen_target
from v41jax.dspark.engine import dspark_generate, measure_round_cost
from v41jax.dspark.scheduler import CostTable
from v41jax.model import generate, init_params

TARGET = ModelConfig(
    vocab_size=16,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
    init_std=0.5,  # peaked logits, so greedy paths are well separated
)
# A staircase: verifying up to 2 tokens per row costs the same, then the price jumps.
STAIRS = CostTable(tokens=(8, 16, 24, 32, 40, 48), seconds=(1.0, 1.0, 2.0, 2.0, 3.0, 3.0))


def drafter_cfg(**kw):
    base = dict(block_size=3, num_layers=1, num_heads=4, window=16, markov_rank=4)
    return DrafterConfig(**{**base, **kw})


@functools.cache
def models(cfg=TARGET, dcfg=None, seed=0):
    dcfg = dcfg or drafter_cfg()
    tp = init_params(cfg, jax.random.key(seed))
    frozen = frozen_target(tp, cfg)
    f = len(dcfg.layer_ids_for(cfg.num_layers)) * cfg.d_model
    variables = Drafter(dcfg, cfg).init(
        jax.random.key(seed + 1),
        frozen,
        np.zeros((1, 2, f), np.float32),
        np.arange(2, dtype=np.int32)[None],
        np.ones((1, 2), bool),
        np.zeros((1, 1), np.int32),
        np.ones((1, 1), np.int32),
    )
    return tp, jax.tree.map(np.asarray, variables["params"]), frozen, dcfg


def prompts(b, seed=0, v=TARGET.vocab_size):
    rng = np.random.default_rng(seed)
    return rng.integers(0, v, (b, 6)).astype(np.int32), rng.integers(1, 7, b).astype(np.int32)


@pytest.mark.parametrize(
    "mode",
    ["fixed", pytest.param("scheduled", marks=pytest.mark.slow)],  # the same head
)
def test_greedy_equals_plain_greedy_contextual_markov(mode):
    """The contextual Markov head (drafts read hidden states too; o != 0 so it acts)."""
    tp, dp, frozen, dcfg = models(dcfg=drafter_cfg(markov_context=8))
    dp = {**dp, "markov": {**dp["markov"], "o": np.full((8, 4), 0.5, np.float32)}}
    toks, lens = prompts(4, seed=2)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=16))
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=16, mode=mode, cost=STAIRS
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def exact_law(cfg, params, prompt, n):
    """Exact joint law of the first n continuation tokens at temperature 1 (enumeration)."""
    from v41jax.model import Transformer

    v, probs = cfg.vocab_size, np.ones(1)
    for i in range(n):
        cont = np.array(list(itertools.product(range(v), repeat=i)), np.int32).reshape(v**i, i)
        seqs = np.concatenate([np.tile(prompt, (v**i, 1)), cont], 1).astype(np.int32)
        logits = Transformer(cfg).apply({"params": params}, seqs).logits[:, -1]
        probs = (probs[:, None] * np.asarray(jax.nn.softmax(logits), np.float64)).reshape(-1)
    return probs


def _g_pvalue(cells, probs):
    counts = np.bincount(cells, minlength=probs.size).astype(np.float64)
    keep = probs * counts.sum() >= 5  # merge small cells into one
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    obs, exp = obs[exp > 0], exp[exp > 0]
    exp *= obs.sum() / exp.sum()  # the law's float64 rounding, not the samples
    return stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue


# The fixed mode's device loop samples what the host loop does (test_host_loop_matches_device_loop)
@pytest.mark.parametrize("mode", [pytest.param("fixed", marks=pytest.mark.slow), "scheduled"])
def test_sampled_output_follows_the_target_law(mode):
    """12k rows of one prompt: tokens 2 and 3 come from the first DSpark round (drafts,
    verification, residual or bonus); their joint law must be the target's (G-test over 64
    cells) at a fixed seed, and must not fit the law of a slightly different model (power)."""
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    dcfg = drafter_cfg(block_size=2)
    tp, dp, frozen, dcfg = models(cfg, dcfg, seed=3)
    prompt, b = np.array([1, 5, 2], np.int32), 12_000
    out = dspark_generate(
        tp,
        cfg,
        dp,
        dcfg,
        frozen,
        np.tile(prompt, (b, 1)),
        np.full((b,), 3, np.int32),
        max_new_tokens=3,
        mode=mode,
        cost=STAIRS,
        temperature=1.0,
        rng=jax.random.key(4),
    )
    toks = np.asarray(out.tokens)
    law = exact_law(cfg, tp, prompt, 3).reshape(8, 8, 8).sum(0).reshape(-1)  # tokens 2, 3
    cells = toks[:, 1] * 8 + toks[:, 2]
    acc = np.asarray(out.accepted)[0]
    assert (acc == 0).any() and (acc > 0).any()  # both rejection and acceptance happened
    assert _g_pvalue(cells, law) > 1e-3
    # negative control: the same samples against the law of the target with weights x 0.8
    wrong = exact_law(cfg, jax.tree.map(lambda x: 0.8 * x, tp), prompt, 3)
    assert _g_pvalue(cells, wrong.reshape(8, 8, 8).sum(0).reshape(-1)) < 1e-6


def test_engram_target():
    eng = EngramConfig(
        engram_vocab_size=(101, 103),
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(0,),
        compressed_vocab_size=16,
    )
    cfg = dataclasses.replace(TARGET, engram=eng)
    tp, dp, frozen, dcfg = models(cfg, seed=6)
    compression = np.arange(16, dtype=np.int32)
    toks, lens = prompts(3, seed=2)
    want = generate(tp, cfg, toks, lens, max_new_tokens=10, compression=compression)
    out = dspark_generate(
        tp, cfg, dp, dcfg, frozen, toks, lens, max_new_tokens=10, compression=compression
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want))


def test_measured_cost_table_feeds_the_scheduler():
    tp, dp, frozen, dcfg = models()
    cost = measure_round_cost(tp, TARGET, dp, dcfg, frozen, batch_size=2, rounds=2, passes=1)
    assert cost.tokens == (4, 6, 8) and all(s > 0 for s in cost.seconds)
    toks, lens = prompts(2)
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=6, mode="scheduled", cost=cost
    )
    assert np.asarray(out.tokens).shape == (2, 6)
    with pytest.raises(ValueError, match="rounds=0"):
        measure_round_cost(tp, TARGET, dp, dcfg, frozen, batch_size=2, rounds=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        measure_round_cost(tp, TARGET, dp, dcfg, frozen, batch_size=2, rounds=40)
