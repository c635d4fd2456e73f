"""Confidence-scheduled verify lengths (DSpark, DeepSeek-V4.1 report).

Worked examples of every basis and of the engine's measured cost table: docs/dspark.md.

A decode step holds B requests, each with K drafts and per-draft confidences c [B, K] (the
drafter's estimate of the conditional acceptance probability of draft j given drafts < j).
The survival of draft j of request b (1-based) is the probability that it is accepted:

    s[b, j] = prod_{i <= j} c[b, i]                (non-increasing in j, since c <= 1)

Verifying a prefix of L_b drafts of request b yields, in expectation, 1 + sum_{j <= L_b} s[b, j]
tokens (the accepted drafts plus the one token the verifier always emits). For a total budget
of n = sum_b L_b drafts, the scheduler hands the slots out by survival: every request gets its
first draft (L_b >= 1, so B slots are forced), the other n - B slots go to the largest
survivals among positions j >= 2, ties broken by smaller position, then smaller row. Because
s is non-increasing in j and ties prefer the smaller position, each request gets a prefix.

    tau(n)        = B_active + sum of the survivals of the n chosen slots (expected tokens;
                                             finished rows emit nothing and have s = 0)
    tokens(n)     = B_active + n             basis "total":  the ragged engine verifies each
                                             active request's pending token plus its drafts
                                             (n counts the active rows' drafts; a finished
                                             row verifies nothing, verify_len 0)
                  = B * (1 + max_b L_b(n))   basis "padded": every request padded to the
                                             longest verify length
    throughput(n) = tau(n) / cost(tokens(n))

with cost(.) the measured verify-step cost (`CostTable`). The budget is the global argmax of
throughput over n = B .. B K (first index on ties): the cost curve is a staircase, so the
throughput curve has several local maxima and the first is not necessarily the best. If
throughput(n*) <= (1 + min_gain) throughput(B K), every request verifies all K drafts (the
gain does not pay for the schedule's risk of mis-calibrated confidences).

With basis "padded", drafts below the current longest length cost nothing, so throughput jumps
down where max L grows and rises along each plateau: the argmax sits at the end of a plateau.
The allocation is still by survival (the same rule for both bases; only the budget differs),
so rows whose drafts rank below the next slot are not topped up to the maximum even though an
engine that pads would verify them for free.

Basis "width" is the padded engine's own expectation: one width w for the batch, every active
row verifies w drafts (as this repository's engine does), so

    tau(w) = B_active + sum_b sum_{j <= w} s[b, j],   throughput(w) = tau(w) / cost(B (1 + w))

over w = 1 .. K, the same argmax and min_gain fallback, verify_len = w for every row. It is
the budget rule applied to the slots a padded engine actually verifies: "padded" counts only
the n largest survivals, under-counting wide rounds (on the DSpark experiment's logged rounds
its choices earned 0.997x the best fixed length, "width" 1.000x; `v41jax.dspark.train.replay`).

Basis "total" is the ragged engine's own expectation (`v41jax.decode.engine`, verify
"ragged"). That engine runs a round at a few static packed sizes (`buckets`): a round of t
tokens costs what a round of the smallest bucket >= t costs, so with `buckets` the cost is
read there (a step of the staircase; the budget then fills a bucket up with the next
survivals for free). Its cost table is measured over packed token counts (a whole round:
drafter pass, verify of t packed tokens, acceptance). With `plain_seconds` (the seconds of a
plain round of the B rows: no drafter pass, one token each), "no drafts" is a candidate too:
throughput B_active / plain_seconds; it wins when it beats every budget (first on ties), and
then every verify_len is 0.

Width 0 (basis "width" only): when the cost table has an entry at exactly B tokens (a round
that verifies nothing: one plain decode step, no drafter pass), w = 0 is a candidate too, with
tau(0) = B_active and throughput(0) = B_active / cost(B); it wins when it beats every w >= 1
(first on ties, so a tie goes to 0). verify_len is then 0 for every row. Without a B-token
entry the widths are w = 1 .. K as before.

Admission (basis "width", `v41jax.dspark.decode.admission`): "global" (default) is the argmax above;
"early_stop" is a stopping rule, extend w -> w + 1 while throughput(w + 1) > throughput(w),
with no min_gain fallback (it would read c_K). The bases "total" and "padded" have only
"global".

With admission "global", the verify length is a function of all the confidences, which keeps
speculative sampling exact only if they are fixed before the drafts are sampled (the drafter's
"hidden" confidence head); with "early_stop", the decision to verify draft j reads c_1 .. c_j
only, which is exact also for confidences that read the previous sampled draft ("prev_token").
See v41jax/speculative/pipeline_audit.py and tests/dspark/test_dspark_confidence_admission.py.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from v41jax.decode.engine import bucket_ceil
from v41jax.dspark.decode.admission import ADMISSIONS, Admission, first_width, width_choice

Basis = Literal["total", "padded", "width"]
BASES: tuple[Basis, ...] = get_args(Basis)


@dataclass(frozen=True)
class CostTable:
    """Measured verify-step cost: `seconds[i]` for a step over `tokens[i]` tokens in the batch.

    tokens: strictly increasing positive ints; seconds: positive finite, same length >= 1.
    cost(x) = s_i + (x - t_i) (s_{i+1} - s_i) / (t_{i+1} - t_i), with [t_i, t_{i+1}] the
    segment containing x: linear interpolation inside the table, linear extrapolation of the
    first (last) segment below (above) it; one point = a constant. The result is floored at
    0 (a steep first segment extrapolated far down would go negative).
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        tok, sec = tuple(self.tokens), tuple(self.seconds)
        if len(tok) < 1 or len(tok) != len(sec):
            raise ValueError(
                f"cost table needs tokens and seconds of equal length >= 1, got "
                f"{len(tok)} tokens and {len(sec)} seconds"
            )
        for t in tok:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 1:
                raise ValueError(f"cost table tokens={list(tok)}: {t!r} is not a positive int")
        for a, b in zip(tok, tok[1:], strict=False):
            if b <= a:
                raise ValueError(f"cost table tokens={list(tok)} must strictly increase ({a}, {b})")
        for s in sec:
            if not isinstance(s, int | float | np.number) or not (math.isfinite(s) and s > 0):
                raise ValueError(f"cost table seconds={list(sec)}: {s!r} is not finite and > 0")
        # tuples of Python scalars: hashable, so a table can be a static argument of jit
        object.__setattr__(self, "tokens", tuple(int(t) for t in tok))
        object.__setattr__(self, "seconds", tuple(float(s) for s in sec))

    def _segments(self, xp, x):
        """Index i of the segment used at x (clipped to the end segments outside the table)."""
        t = xp.asarray(self.tokens, xp.float32 if xp is jnp else np.float64)
        i = xp.searchsorted(t, x, side="right") - 1
        return t, xp.clip(i, 0, len(self.tokens) - 2)

    def __call__(self, n):
        """cost(n) in seconds (float64; a float for a scalar n, else an array of n's shape)."""
        x = np.asarray(n, np.float64)
        if len(self.tokens) == 1:
            y = np.full(x.shape, self.seconds[0])
        else:
            t, i = self._segments(np, x)
            s = np.asarray(self.seconds, np.float64)
            y = s[i] + (x - t[i]) * (s[i + 1] - s[i]) / (t[i + 1] - t[i])
        y = np.maximum(y, 0.0)
        return float(y) if y.ndim == 0 else y

    def cost_jnp(self, tokens: jax.Array) -> jax.Array:
        """cost(tokens) as float32 jnp (the same rule as __call__; the table is baked in as
        constants, so this traces inside jit)."""
        x = jnp.asarray(tokens, jnp.float32)
        if len(self.tokens) == 1:
            return jnp.full(x.shape, self.seconds[0], jnp.float32)
        t, i = self._segments(jnp, x)
        s = jnp.asarray(self.seconds, jnp.float32)
        y = s[i] + (x - t[i]) * (s[i + 1] - s[i]) / (t[i + 1] - t[i])
        return jnp.maximum(y, 0.0)

    def to_dict(self) -> dict[str, list]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        if not isinstance(d, dict) or set(d) != {"tokens", "seconds"}:
            keys = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"cost table dict needs exactly keys tokens, seconds; got {keys}")
        return cls(tuple(d["tokens"]), tuple(d["seconds"]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class RaggedCost:
    """The ragged engine's measured round costs (`measure_round_cost(verify="ragged")`):
    `rounds` the seconds of a drafted round by packed token count (drafter pass, verify of
    that many packed tokens, acceptance), `buckets` the packed sizes the engine runs, and
    `plain_seconds` a plain round of the B rows (no drafter pass), or None to never choose
    one. What basis "total" reads (`schedule_verify_lengths(buckets=, plain_seconds=)`)."""

    rounds: CostTable
    buckets: tuple[int, ...]
    plain_seconds: float | None = None

    def __post_init__(self):
        if not isinstance(self.rounds, CostTable):
            raise ValueError(f"rounds must be a CostTable, got {type(self.rounds).__name__}")
        b = tuple(self.buckets)
        if not b or any(y <= x for x, y in zip(b, b[1:], strict=False)) or b[0] < 1:
            raise ValueError(f"buckets={list(b)} must be strictly increasing positive ints")
        object.__setattr__(self, "buckets", tuple(int(x) for x in b))
        p = self.plain_seconds
        if p is not None and not (isinstance(p, int | float) and math.isfinite(p) and p > 0):
            raise ValueError(f"plain_seconds={p!r} must be a finite number > 0 or None")

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds.to_dict(),
            "buckets": list(self.buckets),
            "plain_seconds": self.plain_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RaggedCost:
        if not isinstance(d, dict) or set(d) != {"rounds", "buckets", "plain_seconds"}:
            keys = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"ragged cost dict needs keys rounds, buckets, plain_seconds; got {keys}"
            )
        return cls(CostTable.from_dict(d["rounds"]), tuple(d["buckets"]), d["plain_seconds"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RaggedCost:
        return cls.from_dict(json.loads(Path(path).read_text()))


class Schedule(NamedTuple):
    """verify_len int32 [B] in [1, K] (0 = width 0, basis "width" only); budget int32 scalar
    (n = sum verify_len); expected tokens tau(n), throughput(n) and throughput(B K) (tokens per
    second), float32 scalars."""

    verify_len: jax.Array
    budget: jax.Array
    expected_tokens: jax.Array
    throughput: jax.Array
    full_throughput: jax.Array


def check_schedule_args(
    confidence, cost, basis: Basis, min_gain, admission: Admission = "global"
) -> tuple[int, int]:
    """(B, K) of `schedule_verify_lengths`' arguments; raises ValueError naming the bad value
    (the values of `confidence` only when concrete)."""
    if basis not in BASES:
        raise ValueError(f"basis={basis!r} is not one of {BASES}")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission={admission!r} is not one of {ADMISSIONS}")
    if admission == "early_stop" and basis != "width":
        raise ValueError(
            f"admission='early_stop' is implemented for basis 'width' only, not {basis!r} "
            "(the budget bases rank slots across positions: not a stopping rule as written)"
        )
    if not isinstance(cost, CostTable):
        raise ValueError(f"cost must be a CostTable, got {type(cost).__name__}")
    if isinstance(min_gain, bool) or not isinstance(min_gain, int | float) or not min_gain >= 0:
        raise ValueError(f"min_gain={min_gain!r} must be a number >= 0")
    shape = np.shape(confidence)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"confidence must be [B, K] with B, K >= 1, got shape {shape}")
    if not isinstance(confidence, jax.core.Tracer):
        c = np.asarray(confidence, np.float64)
        bad = c[~(np.isfinite(c) & (c >= 0) & (c <= 1))]
        if bad.size:
            raise ValueError(f"confidence values {bad[:8].tolist()} are not finite in [0, 1]")
    return shape


def check_buckets(buckets, b: int, k: int) -> tuple[int, ...] | None:
    """`buckets` as a tuple: strictly increasing positive ints whose largest holds a round of
    every row verifying K drafts, B (1 + K) tokens (None stays None)."""
    if buckets is None:
        return None
    got = tuple(buckets)
    ok = all(isinstance(x, int | np.integer) and not isinstance(x, bool) and x >= 1 for x in got)
    if not got or not ok or any(y <= x for x, y in zip(got, got[1:], strict=False)):
        raise ValueError(f"buckets={list(got)} must be strictly increasing positive ints")
    if got[-1] < b * (1 + k):
        raise ValueError(
            f"buckets={list(got)}: the largest, {got[-1]}, is below B (1 + K) = {b * (1 + k)} "
            "tokens, a round where every row verifies all its drafts"
        )
    return tuple(int(x) for x in got)


def _token_costs(cost: CostTable, b: int, k: int, buckets) -> np.ndarray:
    """Basis "total": cost by packed token count t = 0 .. B (1 + K) (at the bucket >= t with
    buckets), float64 [B (1 + K) + 1]. t < 2 cannot occur (an active row verifies its
    pending token and >= 1 draft) and is inf; raises if a reachable cost is <= 0."""
    tokens = np.arange(b * (1 + k) + 1)
    secs = np.full(tokens.shape, np.inf)
    read = tokens[2:] if buckets is None else bucket_ceil(tokens[2:], buckets)
    secs[2:] = np.atleast_1d(cost(read))
    if np.any(secs[2:] <= 0):
        t = int(read[np.argmax(secs[2:] <= 0)])
        raise ValueError(f"cost table gives cost {cost(t)} <= 0 at {t} tokens (extrapolated)")
    return secs


def _slot_costs(cost: CostTable, b: int, k: int, basis: Basis) -> np.ndarray:
    """Static cost per candidate: padded -> [K] for max L = 1..K; width -> [K + 1 - w0] for
    w = w0..K (`first_width`). Raises if a cost is <= 0 (throughput undefined)."""
    if basis == "width":
        tokens = b * (1 + np.arange(first_width(cost, b), k + 1))
    else:
        tokens = b * (1 + np.arange(1, k + 1))
    secs = np.atleast_1d(cost(tokens))
    if np.any(secs <= 0):
        t = int(tokens[np.argmax(secs <= 0)])
        raise ValueError(f"cost table gives cost {cost(t)} <= 0 at {t} tokens (extrapolated)")
    return secs


def schedule_verify_lengths(
    confidence_BxK: jax.Array,
    cost: CostTable,
    *,
    basis: Basis = "total",
    min_gain: float = 0.01,
    active_B: jax.Array | None = None,
    useful_B: jax.Array | None = None,
    admission: Admission = "global",
    buckets: tuple[int, ...] | None = None,
    plain_seconds: float | None = None,
) -> Schedule:
    """Verify lengths L [B] from confidences c [B, K] in [0, 1] (see the module docstring).

    `buckets`, `plain_seconds` (basis "total" only): the ragged engine's packed sizes and
    the cost of a plain round (module docstring).

    `admission` (basis "width" only for "early_stop"): "global", the argmax of throughput
    over every width with the min_gain fallback; "early_stop", the stopping rule of
    `v41jax.dspark.decode.admission` (min_gain unread), lossless also when c_k reads the previous
    sampled draft. A cost table with an entry at B tokens lets basis "width" pick width 0.

    `active_B` (bool [B], default all): rows still generating. A finished row emits nothing,
    so it counts neither in "the number of requests" nor with its survivals (late in a batch,
    when few rows are left, this is what makes longer verifies pay); it still occupies its
    slot of the padded batch (the cost's token count is unchanged).

    `useful_B` (int [B], default K): a row that needs m more tokens gains nothing from
    accepting more than m - 1 drafts (the round's last token is always emitted), so its
    survivals at positions j > useful = m - 1 count as 0: E[min(A + 1, m)] = 1 + sum_{j < m}
    s_j. Near the end of a row this shortens its verify; it is known before the round
    (positions only), so it keeps the output law.

    Pure jnp with static shapes (the cost table is baked in as constants): jit-able with the
    confidences traced (jit/vmap it with cost, basis, min_gain closed over); values are
    checked only when concrete.
    """
    b, k = check_schedule_args(confidence_BxK, cost, basis, min_gain, admission)
    active_B = check_active(active_B, b)
    useful_B = check_useful(useful_B, b, k)
    if basis != "total" and (buckets is not None or plain_seconds is not None):
        raise ValueError(f"buckets and plain_seconds are for basis 'total', not {basis!r}")
    buckets = check_buckets(buckets, b, k)
    if plain_seconds is not None:
        ok = isinstance(plain_seconds, int | float | np.number) and not isinstance(
            plain_seconds, bool
        )
        if not ok or not (math.isfinite(plain_seconds) and plain_seconds > 0):
            raise ValueError(f"plain_seconds={plain_seconds!r} must be a finite number > 0")
        plain_seconds = float(plain_seconds)
    conf = jnp.asarray(confidence_BxK, jnp.float32)
    active = jnp.asarray(active_B, bool)
    useful = jnp.asarray(useful_B, jnp.int32)
    return _schedule(
        conf, active, useful, cost, basis, float(min_gain), admission, buckets, plain_seconds
    )


def check_useful(useful_B, b: int, k: int):
    """`useful_B` checked: default K for every row; else int [B] >= 0 (values checked when
    concrete)."""
    if useful_B is None:
        return np.full((b,), k, np.int32)
    dt = jnp.asarray(useful_B).dtype
    if np.shape(useful_B) != (b,) or not jnp.issubdtype(dt, jnp.integer):
        raise ValueError(f"useful_B must be int [{b}], got {dt} {np.shape(useful_B)}")
    if not isinstance(useful_B, jax.core.Tracer) and (low := int(np.min(useful_B))) < 0:
        raise ValueError(f"useful_B must be >= 0, got min {low}")
    return useful_B


def check_active(active_B, b: int):
    """`active_B` checked: default every row; else bool [B]."""
    if active_B is None:
        return np.ones((b,), bool)
    if np.shape(active_B) != (b,) or jnp.asarray(active_B).dtype != jnp.bool_:
        raise ValueError(
            f"active_B must be bool [{b}], got {jnp.asarray(active_B).dtype} {np.shape(active_B)}"
        )
    return active_B


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 8))
def _schedule(
    conf_BxK,
    active_B,
    useful_B,
    cost: CostTable,
    basis: Basis,
    min_gain: float,
    admission: Admission,
    buckets: tuple[int, ...] | None = None,
    plain_seconds: float | None = None,
) -> Schedule:
    b, k = conf_BxK.shape
    conf_BxK = jnp.where(active_B[:, None], conf_BxK, 0.0)
    n_req = jnp.sum(active_B).astype(jnp.float32)  # requests that will emit a token
    useful_BxK = jnp.arange(1, k + 1) <= useful_B[:, None]
    surv_BxK = jnp.where(useful_BxK, jnp.cumprod(conf_BxK, axis=1), 0.0)
    if basis == "total":
        return _total_schedule(surv_BxK, active_B, n_req, cost, min_gain, buckets, plain_seconds)
    m_free = b * (k - 1)  # slots at positions j >= 2, handed out by survival
    forced = jnp.sum(surv_BxK[:, 0])
    secs = jnp.asarray(_slot_costs(cost, b, k, basis), jnp.float32)
    if basis == "width":  # one width for the batch: every row's prefix of w drafts counts
        w0 = first_width(cost, b)
        w, tau, thr, full = width_choice(surv_BxK, n_req, secs, w0, admission, min_gain)
        return Schedule(jnp.full((b,), w), b * w, tau, thr, full)
    if m_free == 0:  # K = 1: every request verifies its single draft
        tau = n_req + forced
        thr = tau / secs[0]
        n = jnp.int32(b)
        return Schedule(jnp.ones((b,), jnp.int32), n, tau, thr, thr)
    # Position-major flat index f = (j - 2) B + row: sorting by (-s, f) is "largest survival
    # first, ties to the smaller position, then the smaller row" with no reliance on stability.
    free_M = surv_BxK[:, 1:].T.reshape(-1)
    flat_M = jnp.arange(m_free, dtype=jnp.int32)
    neg_sorted, order_M = lax.sort((-free_M, flat_M), num_keys=2)
    tau_n = n_req + forced + jnp.concatenate([jnp.zeros(1), jnp.cumsum(-neg_sorted)])  # [M+1]
    # max L after m free slots = max(1, largest position among the first m in order)
    pos_M = order_M // b + 2
    max_len = jnp.concatenate([jnp.ones(1, jnp.int32), lax.cummax(pos_M, axis=0)])
    cost_n = secs[max_len - 1]
    thr_n = tau_n / cost_n
    best = jnp.argmax(thr_n)  # the first index on ties
    full = thr_n[m_free]
    best = jnp.where(thr_n[best] > (1.0 + min_gain) * full, best, m_free)
    rank_M = jnp.zeros(m_free, jnp.int32).at[order_M].set(flat_M)  # inverse permutation
    chosen_BxK1 = (rank_M < best).reshape(k - 1, b).T
    verify_len = 1 + jnp.sum(chosen_BxK1, axis=1, dtype=jnp.int32)
    return Schedule(verify_len, (b + best).astype(jnp.int32), tau_n[best], thr_n[best], full)


def _total_schedule(
    surv_BxK, active_B, n_req, cost: CostTable, min_gain: float, buckets, plain_seconds
) -> Schedule:
    """Basis "total" (module docstring): every active row's first draft is forced, the other
    slots go by survival; tokens(n) = B_active + n counts active rows only (a finished row's
    slots have survival 0 and add no token), read at the bucket >= it."""
    b, k = surv_BxK.shape
    n_act = jnp.sum(active_B, dtype=jnp.int32)
    secs_T = jnp.asarray(_token_costs(cost, b, k, buckets), jnp.float32)
    forced = jnp.sum(surv_BxK[:, 0])
    m_free = b * (k - 1)
    # Position-major flat index f = (j - 2) B + row: sorting by (finished, -s, f) is "active
    # rows first, then largest survival first, ties to the smaller position, then the smaller
    # row" with no reliance on stability. The first n_act (K - 1) slots are the active rows';
    # past them tokens and tau stay put (so the argmax, first on ties, never goes there).
    free_M = surv_BxK[:, 1:].T.reshape(-1)
    flat_M = jnp.arange(m_free, dtype=jnp.int32)
    finished_M = jnp.tile(~active_B, k - 1).astype(jnp.int32)
    _, neg_sorted, order_M = lax.sort((finished_M, -free_M, flat_M), num_keys=3)
    zero = jnp.zeros(1, jnp.float32)
    tau_n = n_req + forced + jnp.concatenate([zero, jnp.cumsum(-neg_sorted)])  # [M + 1]
    drafts_n = n_act + jnp.minimum(jnp.arange(m_free + 1, dtype=jnp.int32), n_act * (k - 1))
    thr_n = tau_n / secs_T[n_act + drafts_n]
    best = jnp.argmax(thr_n)  # the first index on ties
    full = thr_n[m_free]
    best = jnp.where(thr_n[best] > (1.0 + min_gain) * full, best, m_free)
    rank_M = jnp.zeros(m_free, jnp.int32).at[order_M].set(flat_M)  # inverse permutation
    chosen_BxK1 = (rank_M < best).reshape(k - 1, b).T
    verify_len = jnp.where(active_B, 1 + jnp.sum(chosen_BxK1, axis=1, dtype=jnp.int32), 0)
    sched = Schedule(verify_len, drafts_n[best], tau_n[best], thr_n[best], full)
    if plain_seconds is None:
        return sched
    plain = n_req / jnp.float32(plain_seconds)
    take_plain = plain >= sched.throughput
    return Schedule(
        jnp.where(take_plain, 0, sched.verify_len),
        jnp.where(take_plain, 0, sched.budget),
        jnp.where(take_plain, n_req, sched.expected_tokens),
        jnp.where(take_plain, plain, sched.throughput),
        full,
    )
