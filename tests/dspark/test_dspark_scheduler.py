"""The DSpark verify-length scheduler (v41jax/dspark/decode/scheduler.py) and its cost table.

The scheduler's rule (DSpark): survivals s[b, j] = prod_{i<=j} c[b, i]; each request
verifies at least one draft; for every budget n, tau(n) = B + sum of the n largest survivals
(the first B forced), throughput(n) = tau(n) / cost(tokens(n)); the budget is the global
argmax, with a fallback to full length K unless the gain over it is > min_gain. The jitted
scheduler is checked against the float64 brute force `schedule_reference` on a staircase cost
curve, where the throughput curve has several local maxima.
"""

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.dspark.decode.admission import first_width
from v41jax.dspark.decode.scheduler import (
    BASES,
    CostTable,
    Schedule,
    check_active,
    check_schedule_args,
    check_useful,
    schedule_verify_lengths,
)


def schedule_reference(
    confidence,
    cost: CostTable,
    basis: str = "total",
    min_gain: float = 0.01,
    active=None,
    useful=None,
    admission: str = "global",
    buckets=None,
    plain_seconds=None,
) -> Schedule:
    """Brute force in float64 numpy over every budget n = B .. B K (basis "width": every
    width w, `width_reference`); returns a Schedule of numpy values. buckets, plain_seconds:
    basis "total"'s packed sizes (the cost read at the bucket >= tokens) and plain round."""
    b, k = check_schedule_args(confidence, cost, basis, min_gain, admission)
    act = np.asarray(check_active(active, b), bool)
    use = np.asarray(check_useful(useful, b, k))
    surv = np.cumprod(np.asarray(confidence, np.float64), axis=1) * act[:, None]
    surv *= np.arange(1, k + 1)[None, :] <= use[:, None]
    if basis == "width":
        w, tau, thr, full = width_reference(surv, int(act.sum()), cost, b, admission, min_gain)
        lengths = np.full(b, w, np.int32)
        return Schedule(lengths, np.int32(b * w), *(np.float32(x) for x in (tau, thr, full)))
    free = sorted((-surv[r, j], j, r) for r in range(b) for j in range(1, k))
    best = None  # (throughput, n, lengths, tau)
    results = []
    for n in range(b, b * k + 1):
        lengths = np.ones(b, np.int64)
        tau = act.sum() + surv[:, 0].sum()
        for neg_s, _, r in free[: n - b]:
            lengths[r] += 1
            tau -= neg_s
        # total: the ragged engine's tokens, active rows' pending tokens and drafts only
        tokens = act.sum() + lengths[act].sum() if basis == "total" else b * (1 + lengths.max())
        if buckets is not None:
            tokens = min(x for x in buckets if x >= tokens)
        secs = cost(tokens)
        if secs <= 0:
            raise ValueError(f"cost table gives cost {secs} <= 0 at {tokens} tokens")
        results.append((tau / secs, n, lengths, tau))
        if best is None or tau / secs > best[0]:
            best = results[-1]
    full = results[-1]
    if not best[0] > (1.0 + min_gain) * full[0]:
        best = full
    lengths, n = best[2], best[1]
    if basis == "total":  # a finished row verifies nothing
        lengths, n = np.where(act, lengths, 0), lengths[act].sum()
    if plain_seconds is not None and act.sum() / plain_seconds >= best[0]:
        return Schedule(
            np.zeros(b, np.int32), np.int32(0), np.float32(act.sum()),
            np.float32(act.sum() / plain_seconds), np.float32(full[0]),
        )  # fmt: skip
    return Schedule(
        lengths.astype(np.int32), np.int32(n), np.float32(best[3]), np.float32(best[0]),
        np.float32(full[0]),
    )  # fmt: skip


def width_reference(surv, n_act: int, cost, b: int, admission: str, min_gain: float):
    """The plain float64 loop of `admission.width_choice`: (w, tau, throughput, full)."""
    k = surv.shape[1]
    w0 = first_width(cost, b)
    thr, tau = {}, {}
    for w in range(w0, k + 1):
        secs = cost(b * (1 + w))
        if secs <= 0:
            raise ValueError(f"cost table gives cost {secs} <= 0 at {b * (1 + w)} tokens")
        tau[w] = n_act + surv[:, :w].sum()
        thr[w] = tau[w] / secs
    if admission == "global":
        best = w0
        for w in range(w0, k + 1):
            best = w if thr[w] > thr[best] else best
        if not thr[best] > (1.0 + min_gain) * thr[k]:
            best = k
    else:
        best = w0
        while best < k and thr[best + 1] > thr[best]:
            best += 1
    return best, np.float64(tau[best]), np.float64(thr[best]), np.float64(thr[k])


# Staircase: the verify cost jumps every 16 tokens (flat within a step), as on an engine that
# pads the batch to tiles of 16 tokens.
_TOKENS = tuple(range(8, 129, 8))
STAIRS = CostTable(_TOKENS, tuple(1.0 + 0.3 * ((t - 1) // 16) for t in _TOKENS))
# affine with a fixed overhead: per-token cost falls as the batch grows
AFFINE = CostTable((1, 1001), (1.0, 11.0))


def _confidences(seed: int, b: int, k: int) -> np.ndarray:
    """Mixed rows: some near 1 (long prefixes pay), some low (one draft is enough)."""
    rng = np.random.default_rng(seed)
    hi = rng.uniform(0.0, 1.0, (b, 1)) < 0.5
    c = np.where(hi, rng.uniform(0.7, 1.0, (b, k)), rng.uniform(0.0, 0.8, (b, k)))
    return c.astype(np.float32)


@functools.cache
def _jitted(cost: CostTable, basis: str, min_gain: float = 0.01):
    return jax.jit(lambda c: schedule_verify_lengths(c, cost, basis=basis, min_gain=min_gain))


@pytest.mark.parametrize("basis", ["total", "padded"])
@pytest.mark.parametrize("k", [1, 4, 5, 7])
@pytest.mark.parametrize("b", [3, 5, 7])
def test_matches_reference_and_allocates_prefixes_by_survival(b, k, basis):
    for seed in range(3):
        conf = _confidences(1000 * b + 10 * k + seed, b, k)
        got = _jitted(STAIRS, basis)(conf)
        ref = schedule_reference(conf, STAIRS, basis)
        lens = np.asarray(got.verify_len)
        assert got.verify_len.dtype == jnp.int32 and lens.shape == (b,)
        np.testing.assert_array_equal(lens, ref.verify_len)
        assert int(got.budget) == int(ref.budget) == lens.sum()
        for field in ("expected_tokens", "throughput", "full_throughput"):
            np.testing.assert_allclose(float(getattr(got, field)), getattr(ref, field), rtol=1e-5)
        assert lens.min() >= 1 and lens.max() <= k
        # the chosen non-forced slots (positions 2..L_b) are exactly the largest survivals
        surv = np.cumprod(conf.astype(np.float64), axis=1)
        chosen = np.arange(k)[None, :] < lens[:, None]
        chosen[:, 0] = False
        free = np.ones_like(chosen)
        free[:, 0] = False
        if chosen.any() and (free & ~chosen).any():
            assert surv[chosen].min() >= surv[free & ~chosen].max()
        # tau = B + the survivals of the verified prefixes
        np.testing.assert_allclose(ref.expected_tokens, b + surv[chosen | ~free].sum(), rtol=1e-6)


@pytest.mark.parametrize("k", [1, 4, 5])
@pytest.mark.parametrize("b", [3, 6])
def test_width_basis_is_the_padded_engines_expectation(b, k):
    """basis "width": one w for every row, tau(w) = B + sum_b sum_{j <= w} s[b, j] priced at
    B (1 + w) tokens; the argmax over w with the min_gain fallback, against the brute force
    and against the formula directly."""
    for seed, cost in itertools.product(range(3), (STAIRS, AFFINE)):
        conf = _confidences(500 * b + 10 * k + seed, b, k)
        got = _jitted(cost, "width")(conf)
        ref = schedule_reference(conf, cost, "width")
        lens = np.asarray(got.verify_len)
        assert np.all(lens == lens[0]) and int(got.budget) == b * int(lens[0])
        np.testing.assert_array_equal(lens, ref.verify_len)
        surv = np.cumprod(conf.astype(np.float64), axis=1)
        thr = [(b + surv[:, :w].sum()) / cost(b * (1 + w)) for w in range(1, k + 1)]
        w = int(np.argmax(thr)) + 1
        w = w if thr[w - 1] > 1.01 * thr[-1] else k
        assert int(lens[0]) == w
        np.testing.assert_allclose(float(got.throughput), thr[w - 1], rtol=1e-5)
        np.testing.assert_allclose(float(got.full_throughput), thr[-1], rtol=1e-5)


def test_width_basis_counts_every_rows_drafts_the_padded_budget_does_not():
    """A sure row and a doubtful one, K = 3. At w = 2 a padded engine verifies both rows'
    second drafts: tau = 2 + 2 + 1 + 0.2 = 5.2, 5.31 per second, above w = 3's 6.24 / 1.2 =
    5.2, so "width" picks 2. The budget rule hands the sure row its third slot before the
    doubtful row's second (survival 1 > 0.2), so at max length 2 it counts only tau = 5
    (5.10 per second) and picks the full length."""
    conf = np.array([[1.0, 1.0, 1.0], [1.0, 0.2, 0.2]], np.float32)
    cost = CostTable((4, 6, 8), (0.9, 0.98, 1.2))
    width = _jitted(cost, "width", 0.0)(conf)
    assert width.verify_len.tolist() == [2, 2]
    np.testing.assert_allclose(float(width.expected_tokens), 5.2, rtol=1e-6)
    assert schedule_reference(conf, cost, "width", 0.0).verify_len.tolist() == [2, 2]
    padded = _jitted(cost, "padded", 0.0)(conf)
    assert int(np.max(padded.verify_len)) == 3


def test_global_argmax_beats_the_first_local_maximum():
    # B = 1, K = 5: tau(n) = 1.9, 2.71, 3.439, 4.0951, 4.1279; tokens = 1 + n = 2..6.
    # throughput = 1.9, 1.69, 2.15, 2.56, 2.06: n = 1 is a local maximum, n = 4 the global one,
    # and the full length n = 5 is 24% worse than n = 4 (no fallback).
    cost = CostTable((2, 3, 4, 5, 6), (1.0, 1.6, 1.6, 1.6, 2.0))
    conf = np.array([[0.9, 0.9, 0.9, 0.9, 0.05]], np.float32)
    thr = np.array([1.9, 2.71, 3.439, 4.0951, 4.1279]) / np.array(cost.seconds)
    assert thr[0] > thr[1] and np.argmax(thr) == 3
    got = _jitted(cost, "total")(conf)
    assert int(got.budget) == 4 and got.verify_len.tolist() == [4]
    np.testing.assert_allclose(float(got.throughput), thr[3], rtol=1e-5)
    np.testing.assert_allclose(float(got.full_throughput), thr[4], rtol=1e-5)
    assert schedule_reference(conf, cost).verify_len.tolist() == [4]


@pytest.mark.parametrize("gain, expect", [(0.005, [2]), (0.02, [1])])
def test_falls_back_to_full_length_unless_the_gain_is_over_min_gain(gain, expect):
    # B = 1, K = 2, c = (1, 0.5): n = 1 gives 2 tokens at cost 1 (throughput 2); n = 2 gives
    # 2.5 tokens at cost s2, set so that throughput(1) = (1 + gain) throughput(2).
    cost = CostTable((2, 3), (1.0, 2.5 * (1 + gain) / 2))
    conf = np.array([[1.0, 0.5]], np.float32)
    got = _jitted(cost, "total")(conf)
    assert got.verify_len.tolist() == expect
    assert schedule_reference(conf, cost).verify_len.tolist() == expect
    # with min_gain = 0 any strict gain counts
    assert _jitted(cost, "total", 0.0)(conf).verify_len.tolist() == [1]


@pytest.mark.parametrize("basis", BASES)
def test_certain_drafts_verify_everything_and_hopeless_ones_verify_one(basis):
    b, k = 5, 4
    ones = _jitted(AFFINE, basis)(np.ones((b, k), np.float32))
    assert ones.verify_len.tolist() == [k] * b and int(ones.budget) == b * k
    np.testing.assert_allclose(float(ones.expected_tokens), b * (k + 1), rtol=1e-6)
    zeros = _jitted(AFFINE, basis)(np.zeros((b, k), np.float32))
    assert zeros.verify_len.tolist() == [1] * b and int(zeros.budget) == b
    np.testing.assert_allclose(float(zeros.expected_tokens), b)


def test_scheduler_works_under_vmap_and_returns_a_schedule():
    conf = jnp.asarray(np.stack([_confidences(s, 3, 4) for s in range(4)]))
    fn = jax.jit(jax.vmap(lambda c: schedule_verify_lengths(c, STAIRS).verify_len))
    lens = np.asarray(fn(conf))
    for i in range(4):
        np.testing.assert_array_equal(lens[i], schedule_reference(conf[i], STAIRS).verify_len)
    assert isinstance(schedule_verify_lengths(conf[0], STAIRS), Schedule)


def test_cost_table_interpolates_and_extrapolates_linearly():
    cost = CostTable((8, 16, 32), (1.0, 2.0, 2.5))
    assert cost(8) == 1.0 and cost(16) == 2.0 and cost(32) == 2.5
    assert cost(12) == pytest.approx(1.5) and cost(24) == pytest.approx(2.25)
    assert cost(4) == pytest.approx(0.5)  # first segment extended down
    assert cost(0) == 0.0  # ... floored at 0
    assert cost(48) == pytest.approx(3.0)  # last segment extended up
    xs = np.array([0, 4, 8, 12, 16, 24, 32, 48, 100])
    np.testing.assert_allclose(cost(xs), [cost(int(x)) for x in xs])
    np.testing.assert_allclose(np.asarray(jax.jit(cost.cost_jnp)(xs)), cost(xs), rtol=1e-6)
    single = CostTable((16,), (0.25,))
    assert single(1) == single(1000) == 0.25
    assert np.asarray(single.cost_jnp(jnp.arange(3))).tolist() == [0.25] * 3


def test_cost_table_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    STAIRS.save(path)
    assert json.loads(path.read_text()) == STAIRS.to_dict()
    loaded = CostTable.load(path)
    assert loaded == STAIRS and hash(loaded) == hash(STAIRS)
    assert CostTable.from_dict({"tokens": [1, 2], "seconds": [1, 2.5]}).seconds == (1.0, 2.5)


@pytest.mark.parametrize(
    "tokens, seconds, match",
    [
        ((8, 8), (1.0, 2.0), r"\(8, 8\)"),
        ((8, 4), (1.0, 2.0), r"\(8, 4\)"),
        ((0, 4), (1.0, 2.0), "0 is not a positive int"),
        ((8, 16), (1.0, -1.0), "-1.0"),
        ((8, 16), (1.0, float("nan")), "nan"),
        ((8, 16), (1.0,), "2 tokens and 1 seconds"),
        ((), (), "0 tokens"),
    ],
)
def test_cost_table_rejects_bad_tables(tokens, seconds, match):
    with pytest.raises(ValueError, match=match):
        CostTable(tokens, seconds)


def test_cost_table_rejects_bad_dicts():
    with pytest.raises(ValueError, match="flops"):
        CostTable.from_dict({"tokens": [1], "seconds": [1.0], "flops": [3]})


@pytest.mark.parametrize("basis", BASES)
def test_finished_rows_count_for_nothing(basis):
    """A finished row adds neither its forced token nor its survivals to tau; the jitted
    scheduler matches the brute force with a mask; an all-true mask is the default."""
    b, k = 6, 4
    conf = _confidences(7, b, k)
    active = np.array([True, False, True, True, False, True])
    got = schedule_verify_lengths(conf, STAIRS, basis=basis, active_B=active)
    ref = schedule_reference(conf, STAIRS, basis, active=active)
    np.testing.assert_array_equal(np.asarray(got.verify_len), ref.verify_len)
    surv = np.cumprod(conf.astype(np.float64), axis=1) * active[:, None]
    chosen = np.arange(k)[None, :] < ref.verify_len[:, None]
    np.testing.assert_allclose(float(got.expected_tokens), active.sum() + surv[chosen].sum(),
                               rtol=1e-5)  # fmt: skip
    everyone = schedule_verify_lengths(conf, STAIRS, basis=basis, active_B=np.ones(b, bool))
    default = schedule_verify_lengths(conf, STAIRS, basis=basis)
    np.testing.assert_array_equal(np.asarray(everyone.verify_len), np.asarray(default.verify_len))


def test_finished_rows_do_not_bias_the_batch_tail_to_short_verifies():
    """One row left in a batch of 8 with a fixed-cost-dominated step: it should verify as much
    as a full batch of rows like it would. Counting the 7 finished rows as requests (zeroing
    only their confidences) drowns its gain in 7 phantom tokens: a shorter verify."""
    conf = np.full((8, 4), 0.6, np.float32)
    cost = CostTable((1, 1001), (1.0, 6.0))  # 1 s fixed + 5 ms per token
    last = np.arange(8) == 0
    full = schedule_verify_lengths(conf, cost, basis="padded")
    tail = schedule_verify_lengths(conf, cost, basis="padded", active_B=last)
    phantom = schedule_verify_lengths(conf * last[:, None], cost, basis="padded")
    assert int(np.max(full.verify_len)) == int(tail.verify_len[0]) == 4
    assert int(phantom.verify_len[0]) < 4


@pytest.mark.parametrize("basis", BASES)
def test_drafts_past_a_rows_end_count_for_nothing(basis):
    """useful_B caps each row's counted survivals: the jitted scheduler matches the brute
    force; useful = K is the default; and with every row 2 tokens from its end on a rising
    cost, the padded verify shrinks to 1 draft, where without the cap it verifies more."""
    b, k = 6, 4
    conf = _confidences(9, b, k)
    useful = np.array([4, 0, 1, 2, 3, 1], np.int32)
    got = schedule_verify_lengths(conf, STAIRS, basis=basis, useful_B=useful)
    ref = schedule_reference(conf, STAIRS, basis, useful=useful)
    np.testing.assert_array_equal(np.asarray(got.verify_len), ref.verify_len)
    np.testing.assert_allclose(float(got.expected_tokens), float(ref.expected_tokens), rtol=1e-5)
    full = schedule_verify_lengths(conf, STAIRS, basis=basis, useful_B=np.full(b, k, np.int32))
    default = schedule_verify_lengths(conf, STAIRS, basis=basis)
    np.testing.assert_array_equal(np.asarray(full.verify_len), np.asarray(default.verify_len))
    sure = np.full((8, 4), 0.95, np.float32)
    cost = CostTable((1, 1001), (1.0, 11.0))  # 1 s fixed + 10 ms per token
    free = schedule_verify_lengths(sure, cost, basis="padded")
    near_end = schedule_verify_lengths(sure, cost, basis="padded", useful_B=np.full(8, 1, np.int32))
    assert int(np.max(free.verify_len)) == 4 and int(np.max(near_end.verify_len)) == 1


def test_scheduler_rejects_a_bad_useful_count():
    conf = np.full((2, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match="useful_B must be int"):
        schedule_verify_lengths(conf, STAIRS, useful_B=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        schedule_verify_lengths(conf, STAIRS, useful_B=np.ones(3, np.int32))
    with pytest.raises(ValueError, match="useful_B must be >= 0, got min -1"):
        schedule_verify_lengths(conf, STAIRS, useful_B=np.array([1, -1], np.int32))


def test_scheduler_rejects_a_bad_active_mask():
    with pytest.raises(ValueError, match="active_B must be bool"):
        schedule_verify_lengths(np.full((2, 2), 0.5, np.float32), STAIRS, active_B=[1, 0])
    with pytest.raises(ValueError, match=r"\(3,\)"):
        schedule_verify_lengths(np.full((2, 2), 0.5, np.float32), STAIRS, active_B=np.ones(3, bool))


@pytest.mark.parametrize(
    "conf, kwargs, match",
    [
        ([[0.5, 1.5]], {}, "1.5"),
        ([[0.5, float("nan")]], {}, "nan"),
        ([[-0.25, 0.5]], {}, "-0.25"),
        ([0.5, 0.5], {}, r"shape \(2,\)"),
        (np.zeros((0, 3)), {}, r"shape \(0, 3\)"),
        ([[0.5, 0.5]], {"basis": "ragged"}, "'ragged'"),
        ([[0.5, 0.5]], {"min_gain": -0.1}, "-0.1"),
    ],
)
def test_scheduler_rejects_bad_input(conf, kwargs, match):
    with pytest.raises(ValueError, match=match):
        schedule_verify_lengths(np.asarray(conf, np.float32), STAIRS, **kwargs)
    with pytest.raises(ValueError, match=match):
        schedule_reference(np.asarray(conf, np.float32), STAIRS, **kwargs)


def test_scheduler_rejects_a_cost_that_extrapolates_to_zero():
    steep = CostTable((100, 101), (1.0, 2.0))  # 0 s at 99 tokens and below
    # "total" counts active rows only: one row left verifying one draft is 2 tokens
    with pytest.raises(ValueError, match="<= 0 at 2 tokens"):
        schedule_verify_lengths(np.full((2, 2), 0.5, np.float32), steep)
    with pytest.raises(ValueError, match="<= 0 at 4 tokens"):
        schedule_verify_lengths(np.full((2, 2), 0.5, np.float32), steep, basis="padded")


# ---- admission="early_stop" and width 0 (basis "width"; v41jax/dspark/decode/admission.py) -------


def _with_width_zero(cost: CostTable, b: int, frac: float) -> CostTable:
    """`cost` plus a B-token entry (a plain decode step) at frac * cost(2 B)."""
    pts = dict(zip(cost.tokens, cost.seconds, strict=True)) | {b: frac * cost(2 * b)}
    return CostTable(tuple(sorted(pts)), tuple(pts[t] for t in sorted(pts)))


@pytest.mark.parametrize("admission", ["global", "early_stop"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("b", [1, 3, 7])
def test_admissions_and_width_zero_match_the_reference(b, k, admission):
    """Random confidences, odd B and K, with and without a B-token entry (width 0), random
    finished rows and useful counts: the jitted scheduler equals the float64 loop; early_stop
    stops where the next width does not raise the throughput, after strict rises only."""
    rng = np.random.default_rng(100 * b + k)
    seen = set()
    for seed, base in itertools.product(range(2), (STAIRS, AFFINE)):
        conf = _confidences(seed + 7 * b + k, b, k)
        act = rng.uniform(size=b) < 0.8
        use = rng.integers(0, k + 1, b).astype(np.int32)
        for cost in (base, _with_width_zero(base, b, rng.uniform(0.3, 0.9))):
            kw = dict(basis="width", admission=admission, active_B=act, useful_B=use)
            got = schedule_verify_lengths(conf, cost, **kw)
            ref = schedule_reference(conf, cost, "width", admission=admission, active=act,
                                     useful=use)  # fmt: skip
            np.testing.assert_array_equal(np.asarray(got.verify_len), ref.verify_len)
            for field in ("expected_tokens", "throughput", "full_throughput"):
                np.testing.assert_allclose(getattr(got, field), getattr(ref, field), rtol=1e-5)
            w, w0 = int(ref.verify_len[0]), 0 if b in cost.tokens else 1
            seen.add(w)
            assert w0 <= w <= k
            if admission == "early_stop":
                surv = np.cumprod(conf.astype(np.float64), 1) * act[:, None]
                surv *= np.arange(1, k + 1) <= use[:, None]
                thr = [(act.sum() + surv[:, :v].sum()) / cost(b * (1 + v)) for v in range(k + 1)]
                assert all(thr[v + 1] > thr[v] for v in range(w0, w))
                assert w == k or thr[w + 1] <= thr[w]
    assert len(seen) >= 2 or k == 1


def test_early_stop_takes_the_first_local_maximum_without_fallback():
    """B = 1, K = 5 (the global-argmax example above, at the same token counts 1 + w):
    throughput 1.9, 1.69, 2.15, 2.56, 2.06 over w = 1..5. The global rule takes w = 4; the
    stopping rule stops at w = 1 (2 does not beat it); no min_gain fallback to K."""
    cost = CostTable((2, 3, 4, 5, 6), (1.0, 1.6, 1.6, 1.6, 2.0))
    conf = np.array([[0.9, 0.9, 0.9, 0.9, 0.05]], np.float32)
    glob = schedule_verify_lengths(conf, cost, basis="width")
    stop = schedule_verify_lengths(conf, cost, basis="width", admission="early_stop")
    assert glob.verify_len.tolist() == [4] and stop.verify_len.tolist() == [1]
    np.testing.assert_allclose(float(stop.throughput), 1.9, rtol=1e-6)
    flat = CostTable((2, 6), (1.0, 1.0))  # throughput rises all the way: verify K
    rising = schedule_verify_lengths(conf, flat, basis="width", admission="early_stop")
    assert rising.verify_len.tolist() == [5]
    # throughput 1.3 at w = 1, below it after, 1.2935 at K: "global" falls back to K (gain
    # under 1%), the stopping rule stays at 1
    low = np.array([[0.3, 0.3, 0.3, 0.3, 0.3]], np.float32)
    nearly = CostTable((2, 3, 6), (1.0, 1.1, 1.1036))
    assert schedule_verify_lengths(low, nearly, basis="width").verify_len.tolist() == [5]
    stop = schedule_verify_lengths(low, nearly, basis="width", admission="early_stop")
    assert stop.verify_len.tolist() == [1]


@pytest.mark.parametrize("admission", ["global", "early_stop"])
def test_width_zero_is_a_plain_decode_step(admission):
    """With a B-token entry: hopeless drafts -> width 0 (B / cost(B) beats every w >= 1),
    sure ones -> K; under early_stop a tie 0 vs 1 stays at 0; without the entry never 0
    (today's w >= 1)."""
    b, k = 3, 4
    cost = CostTable((3, 6, 15), (1.0, 1.5, 2.0))
    kw = dict(basis="width", admission=admission)
    zeros = schedule_verify_lengths(np.zeros((b, k), np.float32), cost, **kw)
    assert zeros.verify_len.tolist() == [0] * b and int(zeros.budget) == 0
    np.testing.assert_allclose(float(zeros.throughput), b / 1.0)
    assert schedule_verify_lengths(np.ones((b, k), np.float32), cost, **kw).verify_len[0] == k
    if admission == "early_stop":  # the step 0 -> 1 needs a strict gain
        tie = CostTable((3, 6, 15), (1.0, 2.0, 4.0))  # c = 1: throughput(0) = 3 = throughput(1)
        assert schedule_verify_lengths(np.ones((b, k), np.float32), tie, **kw).verify_len[0] == 0
    no_entry = CostTable((6, 15), (1.5, 2.0))
    got = schedule_verify_lengths(np.zeros((b, k), np.float32), no_entry, **kw)
    assert got.verify_len.tolist() == [1] * b


def test_admission_is_validated():
    conf = np.full((2, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match="'greedy'"):
        schedule_verify_lengths(conf, STAIRS, basis="width", admission="greedy")
    for basis in ("total", "padded"):
        with pytest.raises(ValueError, match=f"basis 'width' only, not '{basis}'"):
            schedule_verify_lengths(conf, STAIRS, basis=basis, admission="early_stop")
        with pytest.raises(ValueError, match="early_stop"):
            schedule_reference(conf, STAIRS, basis, admission="early_stop")


@pytest.mark.parametrize("plain", [None, "cheap", "dear"])
@pytest.mark.parametrize("b, k", [(3, 4), (6, 5), (5, 1)])
def test_total_basis_reads_the_ragged_engines_buckets_and_plain_round(b, k, plain):
    """Basis "total" with the ragged engine's packed sizes (cost read at the bucket >= the
    tokens) and its plain round: the jitted scheduler equals the brute force on random
    confidences, finished rows and `useful` caps; a cheap plain round wins, a dear one never."""
    from v41jax.decode.engine import packed_buckets

    buckets = packed_buckets(b, k)
    cost = CostTable((2, 8, 20, 40), (1.0, 1.1, 2.4, 3.0))
    for seed in range(4):
        rng = np.random.default_rng(seed)
        conf = _confidences(seed + 50, b, k)
        active = rng.random(b) < 0.8
        useful = rng.integers(0, k + 1, b).astype(np.int32)
        plain_seconds = {None: None, "cheap": 0.05, "dear": 1e3}[plain]
        kw = dict(active=active, useful=useful, buckets=buckets, plain_seconds=plain_seconds)
        ref = schedule_reference(conf, cost, "total", **kw)
        got = schedule_verify_lengths(
            conf, cost, basis="total", active_B=active, useful_B=useful, buckets=buckets,
            plain_seconds=plain_seconds,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got.verify_len), ref.verify_len)
        assert int(got.budget) == int(ref.budget)
        np.testing.assert_allclose(float(got.throughput), float(ref.throughput), rtol=1e-5)
        if active.any():
            assert (np.asarray(got.verify_len) == 0).all() == (plain == "cheap")
        assert (np.asarray(got.verify_len)[~active] == 0).all()


def test_total_basis_refuses_bad_buckets_and_plain_round():
    conf = np.full((2, 3), 0.5, np.float32)
    with pytest.raises(ValueError, match="below B"):
        schedule_verify_lengths(conf, STAIRS, basis="total", buckets=(2, 4, 7))
    with pytest.raises(ValueError, match="strictly increasing"):
        schedule_verify_lengths(conf, STAIRS, basis="total", buckets=(4, 2, 8))
    with pytest.raises(ValueError, match="plain_seconds=0"):
        schedule_verify_lengths(conf, STAIRS, basis="total", plain_seconds=0)
    with pytest.raises(ValueError, match="for basis 'total'"):
        schedule_verify_lengths(conf, STAIRS, basis="width", buckets=(8,))
