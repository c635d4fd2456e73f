"""The ragged verify engine (`verify="ragged"`): each row verifies its own length in one packed
target call. Greedy output equals plain greedy decoding and the padded engine token for token
(fixed lengths, per-row mixed lengths with zeros, the scheduler, an Engram target, mixed
prompt lengths); sampled output keeps the target's exact law (G-test with a negative control);
the verifier audit passes through the packing and fails when it is off by one; the measured
`RaggedCost` round-trips; bad arguments are refused by name."""

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.config import EngramConfig
from v41jax.decode import generate, loops
from v41jax.decode.engine import Ctx, Static, packed_buckets
from v41jax.decode.sampling import SamplingParams
from v41jax.dspark.decode.engine import FixedLengths, dspark_generate, measure_round_cost
from v41jax.dspark.decode.rounds import DSparkProposer
from v41jax.dspark.decode.scheduler import CostTable, RaggedCost
from v41jax.model.attention import pack_rows
from v41jax.speculative import audit_verifier, speculative_sample


def _law_tests():
    """The sibling test module's tiny target / drafter and law helpers (pytest imports test
    files by path here, so it is loaded by path too)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_dspark_engine_law.py")
    spec = importlib.util.spec_from_file_location("dspark_engine_law_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LAW = _law_tests()
STAIRS, TARGET, drafter_cfg, exact_law = _LAW.STAIRS, _LAW.TARGET, _LAW.drafter_cfg, _LAW.exact_law
models, prompts, g_pvalue = _LAW.models, _LAW.prompts, _LAW._g_pvalue


@dataclass(frozen=True)
class ConfidenceLengths:
    """Per-row lengths from the first confidence (draft-side information, so the law is
    kept): its scrambled digits, floor(frac(997 c_1) (K + 1)) in [0, K], so that rows differ
    and some verify no draft at all."""

    k: int

    def __call__(self, conf_BxK, active_B, useful_B):
        spread = jnp.floor(jnp.mod(conf_BxK[:, 0] * 997.0, 1.0) * (self.k + 1))
        return jnp.clip(spread, 0, self.k).astype(jnp.int32)


def _ragged(
    tp, cfg, dp, dcfg, frozen, toks, lens, n, policy, sampling=None, rng=None, compression=None
):
    """The engine's host loop on the ragged path with an arbitrary per-row policy."""
    lengths = jnp.asarray(lens, jnp.int32)
    c = Ctx(
        nn.unbox(tp),
        (nn.unbox(dp), frozen),
        (sampling or SamplingParams()).as_arrays(),
        None if compression is None else jnp.asarray(compression),
        lengths + n,
    )
    st = Static(cfg, DSparkProposer(dcfg, cfg), n, policy, "ragged")
    rng = jax.random.key(0) if rng is None else rng
    return loops.run_rounds(c, jnp.asarray(toks), lengths, rng, st, "host")


def _cost(b, k=3):
    """A ragged cost table over packed sizes: a fixed cost (B / 6) plus a price per token at
    which a draft pays when its survival is above ~0.3 (so rows get different lengths)."""
    buckets = packed_buckets(b, k)
    sizes = tuple(x for x in buckets if x >= 2)
    rounds = CostTable(sizes, tuple(b / 6 + 0.05 * x for x in sizes))
    return RaggedCost(rounds, buckets, plain_seconds=b / 6 + 0.05 * b)


@pytest.mark.parametrize("verify_len", [1, 3])
def test_fixed_ragged_equals_padded_equals_plain_greedy(verify_len):
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(5, seed=2)  # prompt lengths 1..6
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=14))
    kw = dict(max_new_tokens=14, verify_len=verify_len)
    padded = dspark_generate(tp, TARGET, dp, dcfg, frozen, toks, lens, **kw)
    ragged = dspark_generate(tp, TARGET, dp, dcfg, frozen, toks, lens, verify="ragged", **kw)
    np.testing.assert_array_equal(np.asarray(ragged.tokens), want)
    np.testing.assert_array_equal(np.asarray(padded.tokens), want)
    # the same drafts are verified, so the same drafts are accepted round by round
    np.testing.assert_array_equal(np.asarray(ragged.accepted), np.asarray(padded.accepted))


def test_mixed_per_row_lengths_with_zeros_equal_plain_greedy():
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(6, seed=5)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=16))
    out = _ragged(tp, TARGET, dp, dcfg, frozen, toks, lens, 16, ConfidenceLengths(3))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    used = np.asarray(out.verify_len)[np.asarray(out.active)]
    assert len(set(used.tolist())) >= 2 and (used == 0).any()  # ragged, with zero-draft rows


def test_scheduled_ragged_equals_plain_greedy_and_chooses_per_row():
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(6, seed=7)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=16))
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=16, mode="scheduled",
        cost=_cost(6), verify="ragged",
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    act = np.asarray(out.active)
    per_round = [set(v[a].tolist()) for v, a in zip(np.asarray(out.verify_len), act, strict=True)]
    assert any(len(s) > 1 for s in per_round)  # some round gave rows different lengths


def test_engram_target_ragged():
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
    compression = np.arange(16, dtype=np.int32)[::-1].copy()  # a non-identity table
    toks, lens = prompts(3, seed=2)
    want = generate(tp, cfg, toks, lens, max_new_tokens=10, compression=compression)
    out = _ragged(
        tp, cfg, dp, dcfg, frozen, toks, lens, 10, ConfidenceLengths(3), compression=compression
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want))


@pytest.mark.parametrize("how", ["mixed", "scheduled"])
def test_sampled_ragged_output_follows_the_target_law(how):
    """As test_sampled_output_follows_the_target_law, on the ragged path: tokens 2 and 3 of
    12k rows of one prompt against the exact law, and against a perturbed law (must fail)."""
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    tp, dp, frozen, dcfg = models(cfg, drafter_cfg(block_size=2), seed=3)
    prompt, b = np.array([1, 5, 2], np.int32), 12_000
    toks, lens = np.tile(prompt, (b, 1)), np.full((b,), 3, np.int32)
    kw = dict(sampling=SamplingParams(1.0), rng=jax.random.key(4))
    if how == "mixed":
        out = _ragged(tp, cfg, dp, dcfg, frozen, toks, lens, 3, ConfidenceLengths(2), **kw)
    else:
        cost = _cost(b, k=2)
        out = dspark_generate(
            tp, cfg, dp, dcfg, frozen, toks, lens, max_new_tokens=3, mode="scheduled",
            cost=cost, verify="ragged", **kw,
        )  # fmt: skip
    cells = np.asarray(out.tokens)[:, 1] * 8 + np.asarray(out.tokens)[:, 2]
    acc, used = np.asarray(out.accepted)[0], np.asarray(out.verify_len)[0]
    assert (acc == 0).any() and (acc > 0).any()
    if how == "mixed":
        assert len(set(used.tolist())) == 3  # rows verified 0, 1 and 2 drafts
    law = exact_law(cfg, tp, prompt, 3).reshape(8, 8, 8).sum(0).reshape(-1)
    assert g_pvalue(cells, law) > 1e-3
    wrong = exact_law(cfg, jax.tree.map(lambda x: 0.8 * x, tp), prompt, 3)
    assert g_pvalue(cells, wrong.reshape(8, 8, 8).sum(0).reshape(-1)) < 1e-6


def _through_packing(shift: int):
    """A verifier that gets its target laws as the ragged engine does: packed over rows with
    1 + L_b tokens each, then unpacked to [B, K + 1]; `shift` != 0 is an off-by-one packing."""

    def verifier(key, drafts, q, p, verify_len):
        b, w, _ = p.shape
        packed = pack_rows(verify_len + 1, jnp.full((b,), 5, jnp.int32), b * w, w)
        flat = jnp.roll(packed.from_rows(p), shift, axis=0)
        return speculative_sample(key, drafts, q, packed.to_rows(flat), verify_len)

    verifier.__name__ = f"ragged_packing_shift{shift}"
    return verifier


def test_verifier_audit_through_the_packing_passes_and_an_off_by_one_fails():
    report = audit_verifier(_through_packing(0), num_samples=100_000)
    assert report.passed, report.format()
    broken = audit_verifier(_through_packing(1), num_samples=100_000)
    assert not broken.passed


def test_measured_ragged_cost_round_trips_and_is_read_by_the_scheduler(tmp_path):
    tp, dp, frozen, dcfg = models()
    cost = measure_round_cost(
        tp, TARGET, dp, dcfg, frozen, 3, rounds=2, passes=1, verify="ragged", sizes=(2, 6, 12)
    )
    assert cost.rounds.tokens == (2, 6, 12) and cost.buckets == packed_buckets(3, 3)
    assert cost.plain_seconds > 0 and all(s > 0 for s in cost.rounds.seconds)
    cost.save(tmp_path / "c.json")
    assert RaggedCost.load(tmp_path / "c.json") == cost
    toks, lens = prompts(3, seed=1)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=8))
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=8, mode="scheduled", cost=cost,
        verify="ragged",
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_fixed_lengths_policy_packs_the_sizes_it_is_timed_at():
    from v41jax.dspark.decode.engine import ragged_lengths

    for b, k in ((1, 5), (4, 3), (7, 5)):
        for n in range(2, b * (1 + k) + 1):
            lens = ragged_lengths(n, b, k)
            active = [x for x in lens if x >= 0]
            assert sum(1 + x for x in active) == n and all(1 <= x <= k for x in active)
    assert FixedLengths((1, 2))(None, None, None).tolist() == [1, 2]


def test_bad_arguments_are_refused():
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(3)
    kw = dict(max_new_tokens=4)
    with pytest.raises(ValueError, match="needs loop='host'"):
        dspark_generate(
            tp, TARGET, dp, dcfg, frozen, toks, lens, verify="ragged", loop="device", **kw
        )
    with pytest.raises(ValueError, match="verify='sideways' not in"):
        dspark_generate(tp, TARGET, dp, dcfg, frozen, toks, lens, verify="sideways", **kw)
    with pytest.raises(ValueError, match="reads a RaggedCost"):
        dspark_generate(
            tp,
            TARGET,
            dp,
            dcfg,
            frozen,
            toks,
            lens,
            mode="scheduled",
            cost=STAIRS,
            verify="ragged",
            **kw,
        )
    with pytest.raises(ValueError, match="reads a CostTable"):
        dspark_generate(
            tp, TARGET, dp, dcfg, frozen, toks, lens, mode="scheduled", cost=_cost(3), **kw
        )
    with pytest.raises(ValueError, match="measured for a smaller batch"):
        dspark_generate(
            tp,
            TARGET,
            dp,
            dcfg,
            frozen,
            toks,
            lens,
            mode="scheduled",
            cost=_cost(2),
            verify="ragged",
            **kw,
        )
    prev = drafter_cfg(confidence_input="prev_token")
    tp2, dp2, frozen2, prev = models(dcfg=prev)
    with pytest.raises(ValueError, match="confidence_input='hidden'"):
        dspark_generate(
            tp2,
            TARGET,
            dp2,
            prev,
            frozen2,
            toks,
            lens,
            mode="scheduled",
            cost=_cost(3),
            verify="ragged",
            **kw,
        )
    with pytest.raises(ValueError, match="bucket ratio"):
        packed_buckets(4, 3, ratio=1.0)
    with pytest.raises(ValueError, match="plain_seconds"):
        RaggedCost(CostTable((2,), (1.0,)), (1, 2), plain_seconds=-1.0)
