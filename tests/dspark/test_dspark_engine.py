"""dspark_generate: greedy output equals plain greedy decoding token for token (fixed and
scheduled verify lengths, several batch sizes), the host and device loops agree, the scheduled
width follows the cost table, bad arguments are named. The sampled law, Engram targets, the
contextual Markov head and the measured cost table: test_dspark_engine_law.py.

Most tests decode N = 20 tokens for 5 rows: the same shapes and static arguments, so the
jitted loops compile once for several tests."""

import functools

import jax
import numpy as np
import pytest

from v41jax.config import ModelConfig
from v41jax.decode import SamplingParams, generate
from v41jax.dspark.decode.engine import dspark_generate
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
N = 20  # new tokens of most tests
T1 = SamplingParams(temperature=1.0)  # sampled, not greedy


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
    "mode, b",
    [
        ("fixed", 1),
        ("fixed", 5),
        pytest.param("scheduled", 1, marks=pytest.mark.slow),  # host-loop programs at B=1
        ("scheduled", 5),
    ],
)
def test_greedy_equals_plain_greedy(mode, b):
    """Batch invariance: rows 0..b-1 of a batch of b equal plain greedy decoding of 5 rows."""
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(5)
    want = np.asarray(generate(tp, TARGET, toks, lens, max_new_tokens=N))
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks[:b], lens[:b], max_new_tokens=N, mode=mode, cost=STAIRS
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), want[:b])
    act = np.asarray(out.active)
    assert np.all(np.asarray(out.verify_len)[act] >= 1)
    assert np.all(np.asarray(out.verify_len)[~act] == 0)
    assert np.all(np.asarray(out.accepted) <= np.asarray(out.verify_len))
    assert np.asarray(out.rounds).min() >= N // 4  # at most K + 1 = 4 tokens per round


def test_fixed_verify_length_and_round_counts():
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(5, seed=1)  # the host-loop test's shapes: its device program
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=N, mode="fixed", verify_len=2
    )
    act = np.asarray(out.active)
    assert np.all(np.asarray(out.verify_len)[act] == 2)
    emitted = (np.asarray(out.accepted) + 1) * act
    assert np.all(emitted.sum(0) >= N - 1)  # the prefill emits the first token
    want = generate(tp, TARGET, toks, lens, max_new_tokens=N)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want))


def test_host_loop_matches_device_loop():
    """The same rng gives the same sampled tokens and logs from both loops."""
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(5, seed=5)
    run = functools.partial(
        dspark_generate, tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=N,
        verify_len=2, sampling=T1, rng=jax.random.key(7),
    )  # fmt: skip
    dev, host = run(loop="device"), run(loop="host")
    for name, a, b in zip(dev._fields, dev, host, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert (np.asarray(dev.accepted)[np.asarray(dev.active)] < 2).any()  # some rejections


def test_scheduled_segments_match_one_round_per_call(monkeypatch):
    """The host loop runs a segment of rounds per call while the width holds; with the width
    changing, it gives the tokens and logs of one launch per round (the reference)."""
    from v41jax.decode import loops
    from v41jax.decode.engine import draft_step, verify_step

    # One program per round and width: this round's verify, then the next round's draft.
    @functools.partial(jax.jit, static_argnames=("st", "width"), donate_argnames=("state",))
    def host_step(c, state, d, st, width: int):
        state, d = draft_step(c, verify_step(c, state, d, st, width), st)
        return state, d, loops.host_flags(c, state, d)

    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(5)
    run = functools.partial(
        dspark_generate, tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=N,
        mode="scheduled", cost=STAIRS, sampling=T1, rng=jax.random.key(3),
    )  # fmt: skip
    seg = run()
    monkeypatch.setattr(loops, "host_segment", host_step)
    ref = run()
    for name, a, b in zip(seg._fields, seg, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    length, act = np.asarray(seg.verify_len), np.asarray(seg.active)
    assert len({int(length[r][act[r]].max()) for r in range(len(act)) if act[r].any()}) > 1


@pytest.mark.parametrize(
    "seconds, want",
    [
        ((1.0, 4.0, 9.0), 1),  # a longer verify costs far more than it can return: w = 1
        ((1.0, 1.0, 1.0), 3),  # free: every draft is verified
    ],
)
def test_scheduled_width_follows_the_cost_table(seconds, want):
    """Each round one width for every active row, the one the cost table makes best."""
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(4, seed=3)
    cost = CostTable(tokens=(8, 12, 16), seconds=seconds)
    out = dspark_generate(
        tp, TARGET, dp, dcfg, frozen, toks, lens, max_new_tokens=10, mode="scheduled",
        cost=cost, sampling=T1, rng=jax.random.key(1),
    )  # fmt: skip
    act, lens_log = np.asarray(out.active), np.asarray(out.verify_len)
    assert np.all(lens_log[act] == want)
    assert np.all(lens_log[~act] == 0)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(mode="adaptive"), "mode"),
        (dict(mode="scheduled"), "cost table"),
        (dict(mode="scheduled", cost=STAIRS, loop="device"), "loop='host'"),
        (dict(loop="gpu"), "loop"),
        (dict(verify_len=4), "verify_len"),
        (dict(max_new_tokens=60), "max_seq_len"),
        (dict(sampling=dict(temperature=-1.0)), "temperature"),
    ],
)
def test_bad_arguments_are_named(change, match):
    tp, dp, frozen, dcfg = models()
    toks, lens = prompts(2)
    kwargs = {"max_new_tokens": 8, **change}
    with pytest.raises(ValueError, match=match):
        if "sampling" in kwargs:
            kwargs["sampling"] = SamplingParams(**kwargs["sampling"])
        dspark_generate(tp, TARGET, dp, dcfg, frozen, toks, lens, **kwargs)
