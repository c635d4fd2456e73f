import numpy as np
import pytest

from v41jax.speculative import (
    expected_tokens_per_round,
    interpolate_cost,
    optimal_draft_length,
    walltime_speedup,
    walltime_speedup_measured,
)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_iid_formula_matches_closed_form(a, k):
    want = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    assert expected_tokens_per_round(a, k) == pytest.approx(want, rel=1e-12)
    assert expected_tokens_per_round([a] * k, k) == pytest.approx(want, rel=1e-12)


def test_position_dependent_rates_match_a_simulation():
    """Simulate rounds: accept draft k with probability a_k while all before were accepted;
    tokens = accepted + 1. The mean matches 1 + sum prod a_i (6 sigma)."""
    rates = np.array([0.9, 0.7, 0.5, 0.8, 0.6])
    rng = np.random.default_rng(0)
    n = 200_000
    accepted = np.cumprod(rng.random((n, rates.size)) < rates, axis=1).sum(axis=1)
    tokens = accepted + 1
    sem = tokens.std() / np.sqrt(n)
    assert abs(tokens.mean() - expected_tokens_per_round(rates, 5)) < 6 * sem
    # negative control: the i.i.d. formula with the mean rate is a different number
    assert abs(tokens.mean() - expected_tokens_per_round(rates.mean(), 5)) > 6 * sem


def test_speedup_and_optimal_length():
    assert walltime_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    assert walltime_speedup(0.0, 0, 0.3) == 1.0  # no drafts: plain decoding
    k, s = optimal_draft_length(0.8, 16, cost_ratio=0.05)
    speedups = [walltime_speedup(0.8, j, 0.05) for j in range(17)]
    assert k == int(np.argmax(speedups)) and s == pytest.approx(max(speedups))
    assert optimal_draft_length(0.1, 8, cost_ratio=0.5) == (0, 1.0)  # drafting never pays


def test_measured_cost_curve():
    tokens, seconds = [1, 2, 4, 8], [1.0, 1.0, 1.2, 2.0]  # a staircase-like engine curve
    assert interpolate_cost(tokens, seconds, 3) == pytest.approx(1.1)
    # with a flat verify cost and c = draft/target this equals the ratio formula
    flat = walltime_speedup_measured(0.7, 3, 0.1, [1, 8], [1.0, 1.0])
    assert flat == pytest.approx(walltime_speedup(0.7, 3, 0.1))
    got = walltime_speedup_measured(0.7, 3, 0.1, tokens, seconds)
    assert got == pytest.approx(expected_tokens_per_round(0.7, 3) * 1.0 / (0.3 + 1.2))
    k, _ = optimal_draft_length(
        0.9, 7, draft_step_seconds=0.05, verify_tokens=tokens, verify_seconds=seconds
    )
    assert 1 <= k <= 7
    with pytest.raises(ValueError, match="outside the measured cost table"):
        walltime_speedup_measured(0.7, 9, 0.1, tokens, seconds)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: expected_tokens_per_round(1.2, 3), r"\[0, 1\]"),
        (lambda: expected_tokens_per_round([0.5, 0.5], 3), "k=3 per-position rates"),
        (lambda: expected_tokens_per_round(0.5, -1), "k=-1"),
        (lambda: walltime_speedup(0.5, 2, -0.1), "cost_ratio=-0.1"),
        (lambda: interpolate_cost([1, 1], [1.0, 2.0], 1), "must increase"),
        (lambda: optimal_draft_length(0.5, 3), "exactly one"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
