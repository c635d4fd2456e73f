"""speculative_generate: greedy output equals greedy autoregressive decoding token for token at
several batch sizes (batch invariance), sampled output follows the target's exact law
(caches rolled back correctly across rounds), Engram models work, bad arguments are named."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from scipy import stats

from v41jax.config import EngramConfig, ModelConfig
from v41jax.decode import SamplingParams, generate, sampling_probs
from v41jax.decode.speculative import speculative_generate
from v41jax.model import Transformer, init_params, unscan_tree

TARGET = ModelConfig(
    vocab_size=48,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
    init_std=0.5,  # peaked logits, so greedy paths are well separated
)
DRAFT = dataclasses.replace(TARGET, num_layers=1)


@functools.cache
def models():
    tp = nn.unbox(init_params(TARGET, jax.random.key(0)))
    # A drafter that agrees often but not always: the target's first layer and head (the
    # target's two layers are one scanned run; the one-layer drafter's is "block_0").
    flat = unscan_tree(tp, TARGET.num_layers)
    dp = {k: v for k, v in flat.items() if k != "block_1"}
    return tp, dp


def prompts(b, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, b).astype(np.int32)
    return rng.integers(0, TARGET.vocab_size, (b, 6)).astype(np.int32), lengths


def test_greedy_equals_autoregressive_for_several_batch_sizes(k=3):
    tp, dp = models()
    toks, lens = prompts(7)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=24))
    accepted_some, rejected_some = False, False
    for b in (1, 7):
        out = speculative_generate(
            tp, TARGET, dp, DRAFT, toks[:b], lens[:b], max_new_tokens=24, num_draft=k
        )
        np.testing.assert_array_equal(np.asarray(out.tokens), want[:b])
        counts = np.asarray(out.accepted_counts).sum(axis=0)
        accepted_some |= counts[1:].sum() > 0
        rejected_some |= counts[:k].sum() > 0
    assert accepted_some and rejected_some  # both paths of the round were exercised


def test_full_acceptance_when_the_drafter_is_the_target():
    tp, _ = models()
    toks, lens = prompts(7, seed=1)  # the shapes above: plain `generate` compiles once
    out = speculative_generate(tp, TARGET, tp, TARGET, toks, lens, max_new_tokens=24, num_draft=4)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=24))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert np.all(np.asarray(out.rounds) == 5)  # 1 + 4 x (4 + 1) = 21 < 24 <= 1 + 5 x 5


def exact_marginals(cfg, params, prompt, n, setting):
    """Exact law of each of the first n continuation tokens, by enumerating prefixes."""
    v = cfg.vocab_size
    marginals, prefix_probs = [], np.ones((1,), np.float64)
    for i in range(n):
        seqs = np.array(
            [list(prompt) + list(c) for c in itertools.product(range(v), repeat=i)], np.int32
        )
        logits = Transformer(cfg).apply({"params": params}, jnp.asarray(seqs)).logits[:, -1]
        cond = np.asarray(sampling_probs(logits, setting), np.float64)  # [v^i, v]
        joint = prefix_probs[:, None] * cond
        marginals.append(joint.sum(axis=0))
        prefix_probs = joint.reshape(-1)
    return marginals


def test_sampled_output_follows_the_target_law():
    """20k rows of one prompt, K = 2: tokens 2 and 3 come from verification rounds (after a
    rejection, from the rolled-back caches); each must follow its exact marginal (G-test),
    and sampling with the drafter's own law (a plain generate of the drafter) must not."""
    small = dataclasses.replace(TARGET, vocab_size=8)
    small_d = dataclasses.replace(DRAFT, vocab_size=8)
    tp = nn.unbox(init_params(small, jax.random.key(3)))
    dp = {k: v for k, v in unscan_tree(tp, small.num_layers).items() if k != "block_1"}
    setting = SamplingParams(temperature=1.0, top_k=6)
    prompt = [1, 5, 2]
    b, n = 20_000, 3
    want = exact_marginals(small, tp, prompt, n, setting)
    args = (np.tile(prompt, (b, 1)).astype(np.int32), np.full((b,), 3, np.int32))
    out = speculative_generate(
        tp,
        small,
        dp,
        small_d,
        *args,
        max_new_tokens=n,
        num_draft=2,
        rng=jax.random.key(4),
        sampling=setting,
    )
    draft_only = generate(
        dp, small_d, *args, max_new_tokens=n, rng=jax.random.key(5), sampling=setting
    )
    counts = np.asarray(out.accepted_counts).sum(axis=0)
    assert counts[0] > 0 and counts[1:].sum() > 0
    for i in range(n):
        assert _g_pvalue(np.asarray(out.tokens)[:, i], want[i]) > 1e-3
    assert min(_g_pvalue(np.asarray(draft_only)[:, i], want[i]) for i in range(n)) < 1e-6


def _g_pvalue(tokens, probs):
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.power_divergence(counts[keep], expected, lambda_="log-likelihood").pvalue


def test_engram_models_decode_speculatively():
    eng = EngramConfig(
        engram_vocab_size=(101, 103),
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(0,),
        compressed_vocab_size=TARGET.vocab_size,
    )
    cfg = dataclasses.replace(TARGET, engram=eng)
    tp = init_params(cfg, jax.random.key(6))
    dp = init_params(DRAFT, jax.random.key(7))
    compression = np.arange(TARGET.vocab_size, dtype=np.int32)
    toks, lens = prompts(4, seed=2)
    want = generate(tp, cfg, toks, lens, max_new_tokens=12, compression=compression)
    out = speculative_generate(
        tp, cfg, dp, DRAFT, toks, lens, max_new_tokens=12, num_draft=3, compression=compression
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_draft=0), "num_draft"),
        (dict(max_new_tokens=60), "exceeds the smaller max_seq_len"),
        (dict(draft_cfg=dataclasses.replace(DRAFT, vocab_size=40)), "vocab_size"),
        (dict(sampling=dict(top_p=0.0)), "top_p"),
    ],
)
def test_bad_arguments_are_named(change, match):
    tp, dp = models()
    toks, lens = prompts(2)
    kwargs = dict(draft_cfg=DRAFT, max_new_tokens=8, num_draft=2)
    kwargs.update(change)
    draft_cfg = kwargs.pop("draft_cfg")
    with pytest.raises(ValueError, match=match):
        if "sampling" in kwargs:
            kwargs["sampling"] = SamplingParams(**kwargs["sampling"])
        speculative_generate(tp, TARGET, dp, draft_cfg, toks, lens, **kwargs)
