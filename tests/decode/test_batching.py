"""Continuous batching (`v41jax.decode.batching`): requests of mixed prompt lengths, lengths
and sampling settings stream through fewer slots than requests; each greedy request's output
equals decoding it alone, for plain decoding, padded and ragged DSpark, whatever joined or
left beside it; sampled requests keep the target's law (G-test with a negative control);
requests that cannot fit are refused with their lengths."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.bench.common import CompileCounter
from v41jax.decode import generate, with_context_len
from v41jax.decode.batching import ContinuousBatcher, PlainProposer, Request
from v41jax.decode.engine import packed_buckets
from v41jax.decode.sampling import SamplingParams
from v41jax.dspark.decode.rounds import DSparkProposer


def _law_helpers():
    """tests/dspark/test_dspark_engine_law.py's tiny target / drafter and law helpers (pytest
    imports test files by path here, so it is loaded by path too)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "dspark", "test_dspark_engine_law.py")
    spec = importlib.util.spec_from_file_location("dspark_law_helpers_for_batching", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAW = _law_helpers()
TARGET = LAW.TARGET


def _requests(n, seed, sampling=None):
    rng = np.random.default_rng(seed)
    return [
        Request(
            rng.integers(0, TARGET.vocab_size, int(rng.integers(1, 9))).tolist(),
            int(rng.integers(1, 20)),
            sampling if sampling is not None else SamplingParams(),
            request_id=i,
        )
        for i in range(n)
    ]


def _alone(tp, requests):
    """{request_id: greedy tokens of plain `generate`}: one call (its rows are independent;
    a greedy continuation's prefix is the shorter continuation)."""
    width, longest = max(len(r.prompt) for r in requests), max(r.max_new_tokens for r in requests)
    prompts = np.zeros((len(requests), width), np.int32)
    for i, r in enumerate(requests):
        prompts[i, : len(r.prompt)] = r.prompt
    lengths = np.asarray([len(r.prompt) for r in requests], np.int32)
    out = np.asarray(generate(tp, TARGET, prompts, lengths, max_new_tokens=longest))
    return {r.request_id: out[i, : r.max_new_tokens] for i, r in enumerate(requests)}


DECODERS = {
    "plain": lambda dcfg: (PlainProposer(TARGET.vocab_size), 0, "padded"),
    "padded_L3": lambda dcfg: (DSparkProposer(dcfg, TARGET), 3, "padded"),
    "ragged_L2": lambda dcfg: (DSparkProposer(dcfg, TARGET), 2, "ragged"),
}


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_each_greedy_request_equals_decoding_it_alone(decoder):
    tp, dp, frozen, dcfg = LAW.models()
    proposer, policy, verify = DECODERS[decoder](dcfg)
    params = None if decoder == "plain" else (dp, frozen)
    batcher = ContinuousBatcher(tp, TARGET, params, proposer, slots=3, policy=policy, verify=verify)
    requests = _requests(9, seed=0)
    out = batcher.run(requests)
    assert sorted(c.request_id for c in out) == list(range(9))
    want = _alone(tp, requests)
    for c in out:
        np.testing.assert_array_equal(
            c.tokens, want[c.request_id], err_msg=f"request {c.request_id}"
        )
        assert c.finished_s >= c.started_s >= c.submitted_s
        assert c.rounds <= requests[c.request_id].max_new_tokens - 1
        if decoder != "plain" and c.rounds:
            assert 0 <= c.accepted <= c.drafted
    # requests finished out of order: slots were refilled while others ran on
    assert [c.request_id for c in out] != sorted(c.request_id for c in out)
    assert batcher.busy == 0 and batcher.waiting == 0


def test_greedy_requests_are_unmoved_by_sampled_neighbours_and_refills():
    """Half the requests sample at temperature 1 with top-k; the greedy half still equals
    decoding alone, with a queue that keeps the slots changing."""
    tp, dp, frozen, dcfg = LAW.models()
    greedy = _requests(6, seed=1)
    hot = [
        dataclasses.replace(r, sampling=SamplingParams(1.0, top_k=5), request_id=100 + i)
        for i, r in enumerate(_requests(6, seed=2))
    ]
    mixed = [x for pair in zip(greedy, hot, strict=True) for x in pair]
    batcher = ContinuousBatcher(
        tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), slots=4, policy=2, verify="ragged",
        rng=jax.random.key(7),
    )  # fmt: skip
    out = {c.request_id: c for c in batcher.run(mixed)}
    want = _alone(tp, greedy)
    for r in greedy:
        np.testing.assert_array_equal(out[r.request_id].tokens, want[r.request_id])
    assert all(len(out[r.request_id].tokens) == r.max_new_tokens for r in hot)


@pytest.mark.slow  # the ragged path's law is tested fast in tests/dspark/test_dspark_ragged.py
def test_sampled_requests_follow_the_target_law():
    """6,000 one-prompt requests at temperature 1 through 48 slots of ragged DSpark: tokens 2
    and 3 follow the exact law (G-test) and not a perturbed model's (negative control)."""
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    tp, dp, frozen, dcfg = LAW.models(cfg, LAW.drafter_cfg(block_size=2), seed=3)
    prompt = [1, 5, 2]
    requests = [Request(prompt, 3, SamplingParams(1.0), request_id=i) for i in range(6000)]
    batcher = ContinuousBatcher(
        tp, cfg, (dp, frozen), DSparkProposer(dcfg, cfg), slots=48, policy=2, verify="ragged",
        rng=jax.random.key(11),
    )  # fmt: skip
    out = batcher.run(requests)
    toks = np.stack([c.tokens for c in out])
    assert sum(c.accepted for c in out) > 0 and sum(c.drafted - c.accepted for c in out) > 0
    cells = toks[:, 1] * 8 + toks[:, 2]
    law = LAW.exact_law(cfg, tp, np.asarray(prompt), 3).reshape(8, 8, 8).sum(0).reshape(-1)
    assert LAW._g_pvalue(cells, law) > 1e-3
    wrong = LAW.exact_law(cfg, jax.tree.map(lambda x: 0.8 * x, tp), np.asarray(prompt), 3)
    assert LAW._g_pvalue(cells, wrong.reshape(8, 8, 8).sum(0).reshape(-1)) < 1e-6


def test_requests_that_cannot_fit_are_refused_with_their_lengths():
    tp, dp, frozen, dcfg = LAW.models()
    batcher = ContinuousBatcher(
        tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), slots=2, policy=3
    )
    need = r"prompt length 40 \+ max_new_tokens 20 \+ the drafter's slack 7 = 67 exceeds"
    with pytest.raises(ValueError, match=need + " max_seq_len 64"):
        batcher.submit(Request([1] * 40, 20, request_id="long"))
    with pytest.raises(ValueError, match=r"vocab_size=16\), got \[0, 16\]"):
        batcher.submit(Request([0, 16], 4))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        batcher.submit(Request([1], 0))
    with pytest.raises(ValueError, match="must be a scalar"):
        batcher.submit(Request([1], 3, SamplingParams(np.array([1.0, 0.0]))))
    with pytest.raises(ValueError, match="slots=0"):
        ContinuousBatcher(tp, TARGET, None, PlainProposer(16), slots=0, policy=0)
    assert batcher.waiting == 0
    # a request done at its prefill (one new token) completes too
    (done,) = batcher.run([Request([3, 4], 1, request_id="one")])
    np.testing.assert_array_equal(done.tokens, _alone(tp, [Request([3, 4], 1)])[None])


@dataclasses.dataclass(frozen=True)
class _SpreadLengths:
    """A draft-side policy that meets many programs: each row's length in [0, K] from its
    first confidence's digits (the padded engine verifies the active rows' longest)."""

    ragged: bool

    def __call__(self, confidence_BxK, active_B, useful_B):
        k = confidence_BxK.shape[1]
        lens = (jnp.floor(confidence_BxK[:, 0] * 9973) % (k + 1)).astype(jnp.int32)
        lens = jnp.where(active_B, jnp.minimum(lens, useful_B), 0)
        return lens if self.ragged else jnp.max(lens)


@pytest.mark.parametrize("verify", ["padded", "ragged"])
def test_after_precompile_a_run_compiles_nothing_and_decodes_the_same(verify):
    """`precompile` compiles every refill, verify and plain program a run can reach, on a
    throwaway batch: the run after it compiles nothing (a batcher without it compiles:
    the negative control) and samples exactly what the batcher without it samples."""
    tp, dp, frozen, dcfg = LAW.models()
    proposer = DSparkProposer(dcfg, TARGET)
    policy = _SpreadLengths(verify == "ragged")
    hot = SamplingParams(1.0)
    ids = np.random.default_rng(4).integers(0, TARGET.vocab_size, 20).tolist()
    requests = [  # prompts of 1 .. 20 tokens: two prompt widths (16, 32)
        dataclasses.replace(r, prompt=ids[:n], sampling=hot)
        for n, r in zip((1, 3, 5, 8, 11, 14, 17, 20, 2, 7), _requests(10, seed=4), strict=True)
    ]

    def batcher():  # 5 slots: a Static no other test compiles
        return ContinuousBatcher(
            tp, TARGET, (dp, frozen), proposer, slots=5, policy=policy, verify=verify,
            rng=jax.random.key(3),
        )  # fmt: skip

    warm = batcher()
    k = dcfg.block_size
    want = (0, *packed_buckets(5, k)) if verify == "ragged" else tuple(range(k + 1))
    assert warm.programs() == want
    ran = warm.precompile([len(r.prompt) for r in requests])
    assert warm.row_buckets() == [1, 2, 3, 4, 5]
    # start, refills (2 widths x 1 .. 5 rows, drafting the new rows and, before a plain
    # round, not), programs, the drafter pass after a plain run
    assert ran == 1 + 2 * 5 * (1 + (0 in want)) + len(want) + (0 in want)
    with CompileCounter() as compiled:
        out = {c.request_id: c for c in warm.run(requests)}
    assert compiled.count == 0
    assert sum(c.drafted for c in out.values()) > 0
    with CompileCounter() as cold:  # the same Static, a width precompile did not see
        long = Request([2] * 40, 3, hot, request_id="long")
        (done,) = warm.run([long])
    assert cold.count > 0 and len(done.tokens) == 3
    plain = {c.request_id: c for c in batcher().run(requests)}
    for i, c in out.items():
        np.testing.assert_array_equal(c.tokens, plain[i].tokens, err_msg=f"request {i}")
        assert (c.drafted, c.accepted) == (plain[i].drafted, plain[i].accepted)
    with pytest.raises(ValueError, match=r"prompt_lengths \[0, 3\]"):
        warm.precompile([3, 0])
    warm.submit(long)
    with pytest.raises(RuntimeError, match="0 decoding, 1 queued"):
        warm.precompile([3])


def test_a_short_context_decodes_as_the_full_one_and_refuses_what_it_cannot_hold():
    """`with_context_len`: caches of what the requests need (not max_seq_len) decode every
    greedy request as plain `generate` at the full context does; the batcher refuses a
    request longer than the short context, naming its lengths."""
    tp, dp, frozen, dcfg = LAW.models()
    requests = _requests(7, seed=3)
    need = max(len(r.prompt) + r.max_new_tokens for r in requests)
    full = DSparkProposer(dcfg, TARGET)
    short_cfg = with_context_len(TARGET, need + full.slack)
    assert short_cfg.max_seq_len < TARGET.max_seq_len  # the test shortens something
    want = _alone(tp, requests)
    for verify, policy in (("ragged", 2), ("padded", 3)):
        batcher = ContinuousBatcher(
            tp, short_cfg, (dp, frozen), DSparkProposer(dcfg, short_cfg), slots=3,
            policy=policy, verify=verify,
        )  # fmt: skip
        assert batcher.seq_len == need + full.slack
        out = {c.request_id: c.tokens for c in batcher.run(requests)}
        for r in requests:
            np.testing.assert_array_equal(out[r.request_id], want[r.request_id])
        too_long = Request([1] * 4, need - 3, request_id="long")
        with pytest.raises(
            ValueError, match=r"'long' cannot fit.*max_seq_len " + str(need + full.slack)
        ):
            batcher.submit(too_long)
    for bad in (0, TARGET.max_seq_len + 1, True, 3.0):
        with pytest.raises(ValueError, match="context_len"):
            with_context_len(TARGET, bad)


def test_cancel_drops_queued_and_decoding_requests_and_the_batcher_goes_on_exactly():
    """`cancel` empties the queue and frees every slot mid-decode; requests submitted after
    it decode as they would alone (greedy), untouched by the rows that were dropped."""
    tp, *_ = LAW.models()
    batcher = ContinuousBatcher(tp, TARGET, None, PlainProposer(TARGET.vocab_size), slots=2,
                                policy=0)  # fmt: skip
    for r in _requests(5, seed=5):
        batcher.submit(dataclasses.replace(r, max_new_tokens=max(r.max_new_tokens, 5)))
    batcher.step()  # two decoding, three queued (nothing finishes in one short segment)
    assert (batcher.busy, batcher.waiting) == (2, 3)
    assert batcher.cancel() == 5
    assert (batcher.busy, batcher.waiting) == (0, 0)
    later = _requests(3, seed=6)
    out = {c.request_id: c.tokens for c in batcher.run(later)}
    assert sorted(out) == [0, 1, 2]
    want = _alone(tp, later)
    for r in later:
        np.testing.assert_array_equal(out[r.request_id], want[r.request_id])


class ScriptedGate:
    """A gate whose answers follow a fixed pseudo-random script (not wall time), so the
    batcher's paths (plain runs the gate forces, plain probes, a drafter pass again after
    plain rounds) all run, reproducibly."""

    def __init__(self, seed):
        self.rng, self.calls = np.random.default_rng(seed), []

    def speculate(self):
        return bool(self.rng.random() < 0.5)

    def probe_plain(self):
        return bool(self.rng.random() < 0.2)

    def record(self, mode, tokens, seconds, rounds):
        assert tokens >= 0 and seconds > 0 and rounds >= 1
        self.calls.append((mode, tokens, rounds))


@pytest.mark.parametrize("verify", ["padded", "ragged"])
def test_greedy_requests_equal_decoding_alone_whatever_the_gate_decides(verify):
    """A gate that turns drafting on and off (and a policy that itself mixes plain and
    drafted rounds): every greedy request still equals decoding it alone, both modes ran,
    and every segment was recorded."""
    tp, dp, frozen, dcfg = LAW.models()
    gate = ScriptedGate(seed=3)
    batcher = ContinuousBatcher(
        tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), slots=3, policy=LAW.Mixed(3),
        verify=verify, gate=gate,
    )  # fmt: skip
    requests = _requests(12, seed=4)
    out = batcher.run(requests)
    want = _alone(tp, requests)
    assert sorted(c.request_id for c in out) == list(range(12))
    for c in out:
        np.testing.assert_array_equal(c.tokens, want[c.request_id], err_msg=f"{c.request_id}")
    assert batcher.segments["drafted"] > 0 and batcher.segments["plain"] > 0
    assert sum(c.drafted for c in out) > 0
    # every token after a request's first (sampled at its prefill) is counted once, in the
    # segment that emitted it: the gate's rates divide these by the segments' seconds
    assert sum(t for _, t, _ in gate.calls) == sum(r.max_new_tokens - 1 for r in requests)
    assert {m for m, _, _ in gate.calls} == {"drafted", "plain"}


def test_a_plain_run_goes_on_across_refills_without_a_drafter_pass(monkeypatch):
    """With the policy choosing no drafts, rows finishing and slots refilling do not end
    the plain run: the drafter passes (one per finished run) are fewer than the plain
    segments; greedy output equals decoding alone."""
    from v41jax.decode import batching

    passes, real = [], batching.host_draft

    def counting(c, state, st):
        passes.append(1)
        return real(c, state, st)

    monkeypatch.setattr(batching, "host_draft", counting)
    tp, dp, frozen, dcfg = LAW.models()
    batcher = ContinuousBatcher(
        tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), slots=3, policy=LAW.Never()
    )
    requests = _requests(9, seed=5)
    out = batcher.run(requests)
    want = _alone(tp, requests)
    for c in out:
        np.testing.assert_array_equal(c.tokens, want[c.request_id])
        assert c.drafted == 0
    assert batcher.segments["drafted"] == 0
    assert 0 < len(passes) < batcher.segments["plain"]


@pytest.mark.slow
def test_sampled_requests_follow_the_target_law_with_the_gate_switching():
    """As the law test above, with a scripted gate turning drafting on and off between
    segments (plain runs it forces, drafter passes again after them): the G-test holds and
    the negative control fails."""
    cfg = dataclasses.replace(TARGET, vocab_size=8, init_std=0.3)
    tp, dp, frozen, dcfg = LAW.models(cfg, LAW.drafter_cfg(block_size=2), seed=3)
    prompt = [1, 5, 2]
    requests = [Request(prompt, 3, SamplingParams(1.0), request_id=i) for i in range(6000)]
    gate = ScriptedGate(seed=8)
    batcher = ContinuousBatcher(
        tp, cfg, (dp, frozen), DSparkProposer(dcfg, cfg), slots=48, policy=2, verify="ragged",
        rng=jax.random.key(12), gate=gate,
    )  # fmt: skip
    out = batcher.run(requests)
    assert batcher.segments["drafted"] > 0 and batcher.segments["plain"] > 0
    toks = np.stack([c.tokens for c in out])
    # the joint of all three tokens: a key shared between a refill's first token (t0) and
    # a later draft would couple them, and the law of (t1, t2) alone would not show it
    cells = (toks[:, 0] * 8 + toks[:, 1]) * 8 + toks[:, 2]
    law = LAW.exact_law(cfg, tp, np.asarray(prompt), 3).reshape(-1)
    assert LAW._g_pvalue(cells, law) > 1e-3
    wrong = LAW.exact_law(cfg, jax.tree.map(lambda x: 0.8 * x, tp), np.asarray(prompt), 3)
    assert LAW._g_pvalue(cells, wrong.reshape(-1)) < 1e-6


def test_a_gate_makes_plain_rounds_reachable_under_a_fixed_policy():
    """With a gate, plain segments (and the drafter pass after them) are reachable even for
    a fixed verify length: `programs` lists 0, so `precompile` compiles them."""
    tp, dp, frozen, dcfg = LAW.models()
    for verify, policy in (("padded", 2), ("ragged", 2)):
        kw = dict(slots=3, policy=policy, verify=verify)
        plain = ContinuousBatcher(tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), **kw)
        gated = ContinuousBatcher(
            tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), gate=ScriptedGate(0), **kw
        )
        assert 0 not in plain.programs()
        assert gated.programs() == (0, *plain.programs())


def test_reset_drops_the_batch_and_the_batcher_goes_on_exactly():
    """`reset` frees the batch state; the batcher then decodes new requests from an empty
    batch, each greedy request still equal to decoding it alone."""
    tp, dp, frozen, dcfg = LAW.models()
    batcher = ContinuousBatcher(
        tp, TARGET, (dp, frozen), DSparkProposer(dcfg, TARGET), slots=3, policy=LAW.Mixed(3),
        verify="ragged", gate=ScriptedGate(seed=1),
    )  # fmt: skip
    first = _requests(6, seed=6)
    for r in first:
        batcher.submit(r)
    done = batcher.step()
    assert batcher.reset() == 6 - len(done)
    assert batcher.busy == 0 and batcher.waiting == 0
    requests = _requests(5, seed=7)
    out = batcher.run(requests)
    want = _alone(tp, requests)
    for c in out:
        np.testing.assert_array_equal(c.tokens, want[c.request_id])
