"""dspark_generate, the heavier cases (split from test_dspark_engine.py so that xdist can run
the two files at once): sampled output follows the target's exact law (G-test, with a negative
control that must fail), the contextual Markov head, Engram targets, and a measured round-cost
table feeds the scheduler. Then the engine's width 0 ("no drafts": a plain decode round
without a drafter pass) for both drafter kinds: greedy output equals plain greedy decoding,
sampled output follows the target's law, the host loop backs off between drafter passes, and
the round-cost table carries the plain round's cost."""

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from scipy import stats

from v41jax.config import EngramConfig, ModelConfig
from v41jax.decode import generate, loops
from v41jax.decode.engine import Ctx, Static
from v41jax.decode.sampling import SamplingParams
from v41jax.decode.speculative import ModelProposer
from v41jax.dspark.decode.engine import dspark_generate, measure_round_cost
from v41jax.dspark.decode.rounds import DSparkProposer
from v41jax.dspark.decode.scheduler import CostTable
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import Drafter, frozen_target
from v41jax.model import init_params

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
        sampling=SamplingParams(1.0),
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
    assert cost.tokens == (2, 4, 6, 8) and all(s > 0 for s in cost.seconds)  # w = 0 .. K
    toks, lens = prompts(2)
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=6, mode="scheduled", cost=cost
    )
    assert np.asarray(out.tokens).shape == (2, 6)
    with pytest.raises(ValueError, match="rounds=0"):
        measure_round_cost(tp, TARGET, dp, dcfg, frozen, batch_size=2, rounds=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        measure_round_cost(tp, TARGET, dp, dcfg, frozen, batch_size=2, rounds=40)


PLAIN_N = 12


@dataclass(frozen=True)
class Never:
    """Width 0 every round: plain decoding through the engine."""

    def __call__(self, conf_BxK, active_B, useful_B):
        return jnp.int32(0)


@dataclass(frozen=True)
class Mixed:
    """0 or K from draft-side information only: a pseudo-random function of the confidences
    (DSpark's change every round or so), flipped once a row nears its end (a drafter without
    confidences: plain rounds, then drafted ones, so the drafter must have caught up)."""

    k: int

    def __call__(self, conf_BxK, active_B, useful_B):
        near_end = jnp.min(jnp.where(active_B, useful_B, self.k)) < self.k
        bit = (jnp.floor(jnp.sum(conf_BxK) * 997.0) + near_end) % 2
        return jnp.where(bit == 0, 0, self.k).astype(jnp.int32)


def run_engine(
    kind, policy, toks, lens, temperature=0.0, rng=0, n=PLAIN_N, cfg=TARGET, seed=0, dcfg=None
):
    if kind == "dspark":
        tp, dp, frozen, dcfg = models(cfg, dcfg, seed)
        proposer, params = DSparkProposer(dcfg, cfg), (nn.unbox(dp), frozen)
    else:
        tp = models(cfg, dcfg, seed)[0]
        draft = dataclasses.replace(cfg, num_layers=1)
        params = init_params(draft, jax.random.key(seed + 7))
        proposer = ModelProposer(draft, 3)
    lens = jnp.asarray(lens, jnp.int32)
    c = Ctx(tp, params, SamplingParams(temperature).as_arrays(), None, lens + n)
    st = Static(cfg, proposer, n, policy)
    return loops.run_rounds(c, jnp.asarray(toks), lens, jax.random.key(rng), st, "host"), tp


@pytest.mark.parametrize("kind", ["dspark", "model"])
@pytest.mark.parametrize("policy", [Never(), Mixed(3)], ids=["never", "mixed"])
def test_greedy_with_plain_rounds_equals_plain_greedy(kind, policy):
    toks, lens = prompts(5, seed=2)
    # Without confidences Mixed drafts only near the end: runs of 1, 2, 4, 8, 16 plain rounds
    # bring pos to length + 31, where 35 new tokens leave fewer than K useful drafts (and the
    # drafter's cache must have caught up on the 31 plain slots).
    n = 35 if kind == "model" and isinstance(policy, Mixed) else PLAIN_N
    out, tp = run_engine(kind, policy, toks, lens, n=n)
    want = generate(tp, TARGET, toks, lens, max_new_tokens=n)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want))
    width = np.asarray(out.verify_len)[np.asarray(out.active)]
    assert (width == 0).any()
    if isinstance(policy, Mixed):
        assert (width == 3).any()  # both kinds of round happened
    else:
        assert np.asarray(out.rounds).min() >= PLAIN_N - 1  # one token per plain round


def test_plain_runs_back_off_between_drafter_passes(monkeypatch):
    """While the policy keeps choosing 0, runs of 1, 2, 4, .. plain rounds separate the
    drafter passes that decide it."""
    runs, real = [], loops.plain_segment

    def counting(c, state, d, st, n_rounds):
        runs.append(int(n_rounds))
        return real(c, state, d, st, n_rounds)

    monkeypatch.setattr(loops, "plain_segment", counting)
    toks, lens = prompts(3, seed=1)
    run_engine("dspark", Never(), toks, lens, n=40)
    assert runs[:4] == [1, 2, 4, 8] and max(runs) <= loops.MAX_PLAIN_ROUNDS


@pytest.mark.parametrize("kind", ["dspark", "model"])
def test_sampled_output_with_plain_rounds_follows_the_target_law(kind):
    """12k rows of one prompt through rounds of width 0 and K (Mixed): tokens 2 and 3 must
    follow the target's joint law (G-test), and not a slightly different model's."""
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    dcfg = drafter_cfg(block_size=2)
    prompt, b = np.array([1, 5, 2], np.int32), 12_000
    toks, lens = np.tile(prompt, (b, 1)), np.full((b,), 3, np.int32)
    policy = Mixed(2 if kind == "dspark" else 3)
    out, tp = run_engine(kind, policy, toks, lens, 1.0, rng=4, n=3, cfg=cfg, seed=3, dcfg=dcfg)
    cells = np.asarray(out.tokens)[:, 1] * 8 + np.asarray(out.tokens)[:, 2]
    law = exact_law(cfg, tp, prompt, 3).reshape(8, 8, 8).sum(0).reshape(-1)
    assert _g_pvalue(cells, law) > 1e-3
    wrong = exact_law(cfg, jax.tree.map(lambda x: 0.8 * x, tp), prompt, 3)
    assert _g_pvalue(cells, wrong.reshape(8, 8, 8).sum(0).reshape(-1)) < 1e-6


def test_round_cost_table_has_the_plain_round():
    tp, dp, frozen, dcfg = models()
    cost = measure_round_cost(tp, TARGET, dp, dcfg, frozen, 2, rounds=2, passes=1)
    k = dcfg.block_size
    assert cost.tokens == tuple(2 * (1 + w) for w in range(k + 1))
    assert all(s > 0 for s in cost.seconds)
    no_plain = measure_round_cost(
        tp, TARGET, dp, dcfg, frozen, 2, rounds=2, passes=1, include_plain=False
    )
    assert no_plain.tokens == cost.tokens[1:]


def test_prev_token_head_scheduled_early_stop_greedy_and_law():
    """The prev-token confidence head (c_k reads draft k-1) under the early-stopping admission:
    greedy output equals plain greedy decoding, sampled tokens 2 and 3 follow the target's
    law; the global argmax over such confidences is refused."""
    dcfg = drafter_cfg(confidence_input="prev_token")
    tp, dp, frozen, dcfg = models(TARGET, dcfg, seed=5)
    toks, lens = prompts(8, seed=4)  # B = 8: STAIRS prices the plain round (8 tokens) too
    run = functools.partial(
        dspark_generate, tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=PLAIN_N,
        mode="scheduled", cost=STAIRS,
    )  # fmt: skip
    want = generate(tp, TARGET, toks, lens, max_new_tokens=PLAIN_N)
    np.testing.assert_array_equal(np.asarray(run().tokens), np.asarray(want))
    with pytest.raises(ValueError, match="not lossless"):
        run(admission="global")
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    tp, dp, frozen, dcfg = models(cfg, drafter_cfg(block_size=2, confidence_input="prev_token"), 3)
    prompt, b = np.array([1, 5, 2], np.int32), 12_000
    out = dspark_generate(
        tp, cfg, dp, dcfg, frozen, np.tile(prompt, (b, 1)), np.full((b,), 3, np.int32),
        max_new_tokens=3, mode="scheduled", cost=STAIRS, sampling=SamplingParams(1.0),
        rng=jax.random.key(4),
    )  # fmt: skip
    cells = np.asarray(out.tokens)[:, 1] * 8 + np.asarray(out.tokens)[:, 2]
    law = exact_law(cfg, tp, prompt, 3).reshape(8, 8, 8).sum(0).reshape(-1)
    assert _g_pvalue(cells, law) > 1e-3
