"""Replay logged decode rounds under other verify-width policies: the scheduler's headroom.

A log of rounds at fixed length K (`DSparkOutput` fields, R rounds, B rows) holds per round r
and row b the confidences c[r, b, :], the accepted count A[r, b] of K drafts and whether the
row was active. The acceptance rule decides draft j from its own uniform and (d_j, q_j, p_j),
none of which depends on how many drafts are verified, so verifying only w <= K drafts of the
same round accepts min(A, w) and emits one more token. On a padded engine (one width per
round, `CostTable` of B (1 + w) tokens) a per-round width w_r earns

    tokens_r(w)  = sum_{b active} (1 + min(A[r, b], w))
    seconds_r(w) = cost(B (1 + w))                  (rounds with no active row are skipped)
    throughput   = sum_r tokens_r(w_r) / sum_r seconds_r(w_r)

Policies compared on the same rounds: every fixed L; the scheduler on the logged confidences
as the engine calls it (`round_width`, the rule of `rounds.scheduled_width`: `ENGINE_BASIS`,
active rows; or another basis for comparison); and the oracle bound, the best ratio any
per-round choice reaches, even one that sees A (not lossless), so an upper bound on every
draft-side policy. It is solved exactly by Dinkelbach's method:
lambda* = max ratio is the root of F(lambda) = sum_r max_w [tokens_r(w) - lambda seconds_r(w)];
iterating lambda <- ratio of the argmax choices increases lambda until F = 0 (finitely many
choice sets, so it stops).

Width 0 (a plain decode step: no drafter pass, one token per active row, tokens_r(0) =
B_active at cost(B)) is a candidate of the scheduler and of the oracle when the cost table has
an entry at B tokens (`v41jax.dspark.decode.admission.first_width`), and "plain" reports its
throughput; without one the widths are 1 .. K as before.

The replay holds each round's draws fixed: a different width would have moved later rounds'
positions, whose law is the same but whose batch tail is not. It measures per-round
(steady-state) throughput, not a static batch's makespan, and ignores `useful_B` (the log
has no positions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from v41jax.dspark.analysis.round_logs import check_log
from v41jax.dspark.decode.admission import first_width
from v41jax.dspark.decode.rounds import ENGINE_BASIS
from v41jax.dspark.decode.scheduler import CostTable, schedule_verify_lengths


def stack_rounds(logs) -> dict[str, np.ndarray]:
    """Logs of batches of the same size B (dicts of `DSparkOutput` fields) as one log of all
    their rounds: [sum R, B] (not `analysis.merge_logs`, which puts batches side by side)."""
    keys = ("confidence", "verify_len", "accepted", "active")
    logs = list(logs)
    if not logs:
        raise ValueError("no logs to stack")
    widths = sorted({np.shape(lg["active"])[1] for lg in logs})
    if len(widths) != 1:
        raise ValueError(f"logs of different batch sizes {widths} cannot be stacked by round")
    return {k: np.concatenate([np.asarray(lg[k]) for lg in logs], axis=0) for k in keys}


def round_width(conf_BxK, cost: CostTable, active_B, basis: str = ENGINE_BASIS, **kw) -> int:
    """The width the engine takes for a round with an active row (`rounds.scheduled_width`):
    the largest scheduled length over the active rows. Finished rows are left out rather
    than counted as 1, so that width 0 (every active row 0) survives."""
    sched = schedule_verify_lengths(conf_BxK, cost, basis=basis, active_B=active_B, **kw)
    return int(np.max(np.asarray(sched.verify_len)[np.asarray(active_B)]))


def _round_tables(accepted, active, cost: CostTable, k: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [R', W] and seconds [R', W] of each round with an active row, for w = w0 .. K
    (W = K + 1 - w0; w0 = 0 with a B-token entry in the table, else 1)."""
    rounds = active.any(axis=1)
    acc, act = accepted[rounds], active[rounds]
    b = act.shape[1]
    w0 = first_width(cost, b)
    w = np.arange(w0, k + 1)
    lo, hi = min(cost.tokens), max(cost.tokens)
    if b * (1 + w0) < lo or b * (1 + k) > hi:
        raise ValueError(
            f"cost table covers {lo}..{hi} tokens, but a padded batch of B={b} verifies "
            f"{b * (1 + w0)}..{b * (1 + k)}: measure it at this batch size (or stack_rounds, "
            "not merge_logs)"
        )
    tokens = (act[:, :, None] * (1 + np.minimum(acc[:, :, None], w))).sum(axis=1)
    seconds = np.broadcast_to(np.atleast_1d(cost(b * (1 + w))), tokens.shape)
    return tokens.astype(np.float64), np.asarray(seconds, np.float64)


def oracle_widths(
    tokens_RxK: np.ndarray, seconds_RxK: np.ndarray, first: int = 1
) -> tuple[np.ndarray, float]:
    """The per-round widths ([R]; column i is width first + i) that maximise sum tokens / sum
    seconds, and that ratio (Dinkelbach; ties to the smaller width)."""
    t, s = np.asarray(tokens_RxK, np.float64), np.asarray(seconds_RxK, np.float64)
    if t.ndim != 2 or t.shape != s.shape or t.shape[0] == 0:
        raise ValueError(f"tokens {t.shape} and seconds {s.shape} must both be [R >= 1, K]")
    if np.any(s <= 0):
        raise ValueError(f"seconds must be > 0, got min {s.min()}")
    rows = np.arange(t.shape[0])
    pick = np.zeros(t.shape[0], int)  # start from w = 1 everywhere
    lam = t[rows, pick].sum() / s[rows, pick].sum()
    for _ in range(10_000):
        nxt = np.argmax(t - lam * s, axis=1)
        new = t[rows, nxt].sum() / s[rows, nxt].sum()
        if new <= lam * (1 + 1e-12):
            break
        pick, lam = nxt, new
    return pick + first, float(lam)


def replay_policies(
    confidence, verify_len, accepted, active, cost: CostTable, bases=(ENGINE_BASIS,), **kw
) -> dict[str, Any]:
    """Throughput (tokens per cost-second) of fixed L = 1 .. K, the scheduler with each of
    `bases` and the oracle bound on the rounds of a fixed-length-K log (see the module
    docstring); several batches of the same size: `stack_rounds`. `kw` go to
    `schedule_verify_lengths` (e.g. min_gain). Returns {"fixed": [K], "oracle": float,
    "oracle_widths": mean width, "scheduled": {basis: float}, "scheduled_widths": {basis:
    mean width}, "plain": width 0's throughput or None (no B-token entry), "rounds": R'}."""
    conf, length, acc, act, k = check_log(confidence, verify_len, accepted, active)
    if not isinstance(cost, CostTable):
        raise ValueError(f"cost must be a CostTable, got {type(cost).__name__}")
    if not act.any():
        raise ValueError("the log has no active row: no round to replay")
    if np.any(length[act] != k):
        bad = np.unique(length[act][length[act] != k])
        raise ValueError(f"the log must verify all K={k} drafts per active row; found {bad}")
    if not bases or any(b not in ("padded", "width") for b in bases):
        raise ValueError(f"bases={bases!r}: a padded engine's widths need 'padded' or 'width'")
    tokens, seconds = _round_tables(acc, act, cost, k)
    rows = np.arange(tokens.shape[0])
    w0 = first_width(cost, act.shape[1])

    def ratio(widths: np.ndarray) -> float:
        return float(tokens[rows, widths - w0].sum() / seconds[rows, widths - w0].sum())

    live = act.any(axis=1)
    out: dict[str, Any] = {
        "fixed": [ratio(np.full(len(rows), w)) for w in range(1, k + 1)],
        "plain": ratio(np.zeros(len(rows), int)) if w0 == 0 else None,
        "scheduled": {},
        "scheduled_widths": {},
    }
    for basis in bases:  # the round's width as the engine takes it
        widths = np.array(
            [
                round_width(c, cost, a, basis=basis, **kw)
                for c, a in zip(conf[live], act[live], strict=True)
            ]
        )
        out["scheduled"][basis] = ratio(widths)
        out["scheduled_widths"][basis] = float(widths.mean())
    oracle, best = oracle_widths(tokens, seconds, w0)
    out.update(oracle=best, oracle_widths=float(oracle.mean()), rounds=int(len(rows)))
    return out
