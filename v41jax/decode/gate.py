"""Speculation on or off, from the serving loop's own measured throughput.

The scheduler (`v41jax.dspark.decode.scheduler`) prices a round with a cost table measured
on an isolated batch: whole segments at one program, every row decoding. A serving loop
pays more than that table for drafting: under load a row finishes in nearly every round, so
every drafted round is a segment of its own, followed by a refill, and the drafts of the
rows that ended are thrown away; a plain run in that loop needs no drafter pass at all. How
much more depends on the load, the prompts and the machine, so it is measured where it is
paid: `SpeculationGate` keeps the decode throughput of the two modes as the batcher meets
them,

    rate(mode) = sum_i w_i tokens_i / sum_i w_i seconds_i,    w_i = decay^(age of segment i)

over the segments run in that mode (`record`; "drafted": segments whose rounds the policy
chose, "plain": plain runs; a segment's seconds run from its launch to its result on the
host, refills excluded: a prefill costs the same per request whichever mode decodes it; so
is the drafter pass that lets the policy decide after plain rounds, the price of switching,
which the probes keep rare: each mode's rate is what it earns while it runs), and says
whether the next decision goes to the policy (`speculate`):

    speculate  <=>  rate(drafted) or rate(plain) unknown, or rate(drafted) > rate(plain),
                    or the drafted mode is due a probe (>= probe_rounds plain rounds since it
                    was last measured: loads change; the interval doubles while plain keeps
                    winning, up to max_probe_rounds)

and a plain probe is forced once the drafted mode has run probe_rounds rounds without a
plain measurement (`probe_plain`), so both rates stay current. When it says no, the batcher
runs plain rounds without drafting; when yes, the policy (the confidence scheduler) decides
the verify lengths as before, and may itself choose a plain round.

The decision reads past segments only (their tokens and wall time), never the drafts of the
round it decides, so speculative sampling keeps the target's law; greedy output is the same
token for token whatever the gate decides. Sampled output is reproducible in law, not token
for token: which rounds draft depends on wall time, and drafted and plain rounds draw
different random numbers. Written here rather than taken from a library: it is a few lines of
bookkeeping on the batcher's own segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["drafted", "plain"]
MODES: tuple[Mode, ...] = ("drafted", "plain")


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    rounds_since: int = 0  # rounds of the other mode since this one was last measured

    @property
    def known(self) -> bool:
        return self.seconds > 0

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


@dataclass
class SpeculationGate:
    """The measured throughput of drafted and plain decoding in the serving loop (module
    docstring). `decay` in (0, 1]: weight of a segment per newer segment of the same mode;
    `probe_rounds` >= 1: rounds of one mode before the other is measured again (doubling
    while plain wins, up to `max_probe_rounds`)."""

    decay: float = 0.7
    probe_rounds: int = 32
    max_probe_rounds: int = 256
    _rates: dict = field(default_factory=lambda: {m: _Rate() for m in MODES}, repr=False)
    _interval: int = field(default=0, repr=False)

    def __post_init__(self):
        if not (isinstance(self.decay, int | float) and 0 < self.decay <= 1):
            raise ValueError(f"decay={self.decay!r} must lie in (0, 1]")
        for name in ("probe_rounds", "max_probe_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.max_probe_rounds < self.probe_rounds:
            raise ValueError(
                f"max_probe_rounds={self.max_probe_rounds} must be >= probe_rounds="
                f"{self.probe_rounds}"
            )
        self._interval = self.probe_rounds

    def record(self, mode: Mode, tokens: int, seconds: float, rounds: int) -> None:
        """One segment: `tokens` emitted in `seconds` over `rounds` rounds in `mode`."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} not in {MODES}")
        if not (math.isfinite(seconds) and seconds > 0) or tokens < 0 or rounds < 1:
            raise ValueError(
                f"a segment needs seconds > 0, tokens >= 0, rounds >= 1; got {seconds!r}, "
                f"{tokens!r}, {rounds!r}"
            )
        mine, other = self._rates[mode], self._rates[_other(mode)]
        was_probe = mode == "drafted" and mine.rounds_since >= self._interval
        mine.tokens = self.decay * mine.tokens + tokens
        mine.seconds = self.decay * mine.seconds + seconds
        mine.rounds_since = 0
        other.rounds_since += rounds
        if was_probe and mine.known and other.known:  # plain still wins: probe less often
            if mine.value <= other.value:
                self._interval = min(2 * self._interval, self.max_probe_rounds)
            else:
                self._interval = self.probe_rounds

    def rate(self, mode: Mode) -> float:
        """Measured tokens per second of `mode` (nan before its first segment)."""
        return self._rates[mode].value

    def speculate(self) -> bool:
        """Whether the next decision goes to the policy (else: plain rounds, no drafting)."""
        d, p = self._rates["drafted"], self._rates["plain"]
        if not d.known or not p.known or d.value > p.value:
            return True
        return d.rounds_since >= self._interval

    def probe_plain(self) -> bool:
        """Whether a plain run is due although drafting wins (plain unmeasured, or stale)."""
        p = self._rates["plain"]
        return self._rates["drafted"].known and (not p.known or p.rounds_since >= self.probe_rounds)

    def summary(self) -> dict:
        """{mode: tokens/s} and the current probe interval (for logs and benchmarks)."""
        return {**{m: self.rate(m) for m in MODES}, "probe_rounds": self._interval}


def _other(mode: Mode) -> Mode:
    return "plain" if mode == "drafted" else "drafted"
