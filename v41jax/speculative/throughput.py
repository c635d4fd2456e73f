"""The throughput model of speculative decoding (Leviathan et al. 2023).

A round drafts K tokens and verifies them with one target pass. Let a_k be the probability
that draft k is accepted given drafts 1..k-1 were (the conditional acceptance rate; i.i.d.
drafts have a_k = a). The round emits the accepted prefix plus one more token (the residual
sample at the first rejection, or the bonus token after K acceptances), so with A the number
of accepted drafts, tokens per round = A + 1 and P(A >= k) = prod_{i<=k} a_i. Hence

    E[tokens / round] = 1 + sum_{k=1..K} P(A >= k) = 1 + sum_{k=1..K} prod_{i<=k} a_i,

which for i.i.d. rates is the geometric sum 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)
(= K + 1 at a = 1).

Wall time: a round costs K draft steps and one target pass over K + 1 positions. With the
draft step costing c target steps and a verify pass costing about one target step,

    speedup = E[tokens / round] / (K c + 1).

`walltime_speedup_measured` replaces "K c + 1" by measured costs: K * draft_cost +
verify_cost(K + 1), relative to verify_cost(1) (plain decoding), with verify_cost linearly
interpolated from a measured table (an engine's cost curve is a staircase, not a line).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Rates = float | Sequence[float] | np.ndarray


def _survival(alpha: Rates, k: int) -> np.ndarray:
    """P(A >= j) for j = 1..k: prefix products of the per-position rates, float64 [k]."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"draft length k={k!r} must be an int >= 0")
    rates = np.asarray(alpha, np.float64)
    if rates.ndim == 0:
        rates = np.full(k, float(rates))
    elif rates.shape != (k,):
        raise ValueError(
            f"alpha must be a scalar or have k={k} per-position rates, got shape {rates.shape}"
        )
    if rates.size and (not np.all(np.isfinite(rates)) or rates.min() < 0 or rates.max() > 1):
        raise ValueError(f"acceptance rates must lie in [0, 1], got {rates.tolist()}")
    return np.cumprod(rates)


def expected_tokens_per_round(alpha: Rates, k: int) -> float:
    """E[tokens emitted per round] for K = k drafts: `1 + sum_k prod_{i<=k} a_i`.

    alpha: a scalar (i.i.d. acceptance rate) or k conditional per-position rates.
    """
    return float(1.0 + _survival(alpha, k).sum())


def walltime_speedup(alpha: Rates, k: int, cost_ratio: float) -> float:
    """E[tokens / round] / (k * cost_ratio + 1); cost_ratio = draft step / target step."""
    if not np.isfinite(cost_ratio) or cost_ratio < 0:
        raise ValueError(f"cost_ratio={cost_ratio!r} must be finite and >= 0")
    return expected_tokens_per_round(alpha, k) / (k * cost_ratio + 1.0)


def interpolate_cost(tokens: Sequence[int], seconds: Sequence[float], n: float) -> float:
    """Verify cost of n tokens from a measured table (tokens increasing), linear between
    points; outside the table it is an error, not an extrapolation."""
    t = np.asarray(tokens, np.float64)
    s = np.asarray(seconds, np.float64)
    if t.ndim != 1 or t.shape != s.shape or t.size < 1:
        raise ValueError(f"cost table needs matching 1-D tokens/seconds, got {t.shape}, {s.shape}")
    if np.any(np.diff(t) <= 0) or np.any(s <= 0):
        raise ValueError("cost table: tokens must increase and seconds be > 0")
    if not t[0] <= n <= t[-1]:
        raise ValueError(f"{n} tokens is outside the measured cost table [{t[0]:g}, {t[-1]:g}]")
    return float(np.interp(n, t, s))


def walltime_speedup_measured(
    alpha: Rates,
    k: int,
    draft_step_seconds: float,
    verify_tokens: Sequence[int],
    verify_seconds: Sequence[float],
) -> float:
    """Speedup over plain decoding with measured costs:
    `E[tokens / round] * verify(1) / (k * draft_step + verify(k + 1))`."""
    if not np.isfinite(draft_step_seconds) or draft_step_seconds < 0:
        raise ValueError(f"draft_step_seconds={draft_step_seconds!r} must be finite and >= 0")
    plain = interpolate_cost(verify_tokens, verify_seconds, 1)
    round_cost = k * draft_step_seconds + interpolate_cost(verify_tokens, verify_seconds, k + 1)
    return expected_tokens_per_round(alpha, k) * plain / round_cost


def optimal_draft_length(
    alpha: float, k_max: int, cost_ratio: float | None = None, **measured
) -> tuple[int, float]:
    """(k, speedup) maximising the speedup over k in 0..k_max (i.i.d. rate alpha).

    Pass `cost_ratio`, or the measured costs of `walltime_speedup_measured`
    (`draft_step_seconds`, `verify_tokens`, `verify_seconds`). Ties go to the shorter k.
    """
    if (cost_ratio is None) == (not measured):
        raise ValueError("give exactly one of cost_ratio or the measured costs")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max={k_max!r} must be an int >= 0")
    best = (0, -1.0)
    for k in range(k_max + 1):
        s = (
            walltime_speedup(alpha, k, cost_ratio)
            if cost_ratio is not None
            else walltime_speedup_measured(alpha, k, **measured)
        )
        if s > best[1] + 1e-12:
            best = (k, s)
    return best
