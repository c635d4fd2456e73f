"""Continuous batching: a request queue feeding a fixed number of batch slots of the
speculative engine (`v41jax.decode.engine`), so that the batch stays full.

The engine decodes B slots at once. A static batch idles a slot once its row is done, until
the longest row finishes; here the host loop (`ContinuousBatcher.step`) runs segments of
rounds that stop as soon as a row finishes (`Static.stop_on_finish`), hands the finished
request back (`Completion`), and refills free slots with waiting requests between segments:

    refill:  prefill the new prompts (target KV cache, the drafter's state, the first token
             sampled at the prompt's last position), written into their slots (`refill_rows`,
             one program per (number of new rows, prompt width) bucket), and a drafter pass
             over the new rows only; the other rows keep their unverified drafts, and the
             policy decides the round's lengths for the whole batch again. Before a plain
             round the refill drafts nothing, and every row is drafted again
             (`host_draft`) before the next drafted round;
    segment: rounds at one verify program until it changes or a row finishes (host loop);
             a plain run (the policy chose no drafts: 1, 2, 4, .. rounds) goes on across
             refills, with no drafter pass until it is over.

With a `SpeculationGate` (`gate=`), the batcher also measures the decode throughput it gets
from drafted segments and from plain runs, and runs plain rounds, without drafting, while
plain is measured faster (probing the drafted mode now and then): the cost of drafting as
this loop pays it, which the policy's cost table, measured on an isolated batch, does not
see (`v41jax.decode.gate`).

A request's output does not depend on the others: every row reads only its own cache rows,
history and position (attention, the ragged packing and Engram's ids are per row; the
drafter's context is per row), so greedy output equals decoding the request alone, whatever
joined or left beside it. Sampling settings and lengths are per request (the engine's
settings are per-row arrays; a free slot is a finished row, end 0). The cost of refilling:
one prefill (and, before a drafted round, one drafter pass) of the new rows per refill event.

Plain decoding runs through the same loop with `PlainProposer` and policy 0 (every round a
plain round, no drafter pass), so decoders are compared under the same batching.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.decode.engine import (
    MAX_PLAIN_ROUNDS,
    VERIFY_ENGINES,
    Ctx,
    Draft,
    Proposal,
    State,
    Static,
    packed_buckets,
    prefill,
    propose_rows,
    verify_plan,
)
from v41jax.decode.gate import SpeculationGate
from v41jax.decode.loops import host_draft, host_flags, host_segment, host_start, plain_segment
from v41jax.decode.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class PlainProposer:
    """A drafter that never drafts: with policy 0 every round is a plain decode round (the
    engine's width 0), so plain decoding runs through the engine and its batching. Its one
    "draft" per segment is a zero token with a uniform law, never verified."""

    vocab_size: int
    block_size: int = 1
    slack: int = 0
    hidden_layers: tuple[int, ...] = ()

    def seq_len(self, target_cfg: ModelConfig) -> int:
        return target_cfg.max_seq_len

    def init(self, params, target_out, prompts_BxP, lengths_B, compression):
        return None

    def propose(self, params, dstate, history_BxS, pos_B, active_B, key, probs, compression):
        b = pos_B.shape[0]
        q = jnp.full((b, 1, self.vocab_size), 1.0 / self.vocab_size, jnp.float32)
        zeros = jnp.zeros((b, 1), jnp.int32)
        return Proposal(zeros, q, zeros.astype(jnp.float32)), dstate

    def observe(self, params, dstate, history_BxS, target_out, start_B, compression):
        return dstate


@dataclass(frozen=True)
class Request:
    """One generation request: `prompt` token ids (>= 1), `max_new_tokens` (>= 1), its own
    sampling settings (scalars), and an id handed back with its `Completion`."""

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    request_id: Any = None


class Completion(NamedTuple):
    """A finished request: tokens int32 [max_new_tokens]; rounds it took part in, drafts it
    verified and drafts accepted; submitted / started (prefilled) / finished times in seconds
    of the batcher's clock."""

    request_id: Any
    tokens: np.ndarray
    rounds: int
    drafted: int
    accepted: int
    submitted_s: float
    started_s: float
    finished_s: float

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.submitted_s


@dataclass
class _Slot:
    request: Request
    submitted_s: float
    started_s: float = 0.0


def batch_axes(c: Ctx, st: Static, prompt_width: int) -> tuple[int | None, ...]:
    """The batch axis of every leaf of the engine's `State` (flattened order), None for the
    leaves without one (round counter, key): found from the state's shapes at 1 and 2 rows."""

    def state_of(b):
        ctx = Ctx(
            c.target_params,
            c.drafter_params,
            jax.tree.map(lambda x: jax.ShapeDtypeStruct((b,), x.dtype), c.sampling),
            c.compression,
            jax.ShapeDtypeStruct((b,), jnp.int32),
        )
        prompts = jax.ShapeDtypeStruct((b, prompt_width), jnp.int32)
        lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
        return jax.eval_shape(
            functools.partial(prefill, st=st), ctx, prompts, lengths, jax.random.key(0)
        )

    one, two = (jax.tree.leaves(state_of(b)) for b in (1, 2))
    axes = []
    for a, b in zip(one, two, strict=True):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        axes.append(diff[0] if diff else None)
    return tuple(axes)


@functools.partial(
    jax.jit, static_argnames=("st", "axes", "draft_new"), donate_argnames=("state", "draft")
)
def refill_rows(
    c: Ctx, state: State, draft: Draft, rows_R, prompts_RxP, lengths_R, c_rows: Ctx,
    st: Static, axes, draft_new: bool = True,
):  # fmt: skip
    """Prefill R new prompts (right-padded [R, P], lengths [R]) with `c_rows` (their sampling
    settings and ends), draft for those R rows only, and write both into slots `rows_R` of
    `state` and `draft` (a row index B writes nowhere: padding of the R bucket); then the
    policy decides the round's lengths for the whole batch (`verify_plan`). Returns (state,
    draft, host flags) as `host_start` does.

    The other rows keep their drafts: drawn at the end of the last drafted segment and never
    verified, they are what a round without the refill would have verified, so the law is
    kept. (Drafting the whole batch again would cost a drafter pass over every row per
    refill, which at high concurrency, where rows finish nearly every round, is a second
    pass per round.) The verify key and the next round's key come from `draft`, unused so
    far; the new rows' keys are split from its `rng`.

    `draft_new=False` when the next round is plain (a plain run going on, or the gate's
    choice): no drafter pass, no plan (program 0); the new rows' proposals are left as they
    were, so the batcher drafts every row again before any drafted round (`host_draft`)."""
    rng, key, k_draft = jax.random.split(draft.rng, 3)
    new = prefill(c_rows, prompts_RxP, lengths_R, key, st)
    if draft_new:  # the proposer alone (not `draft_step`): the policy decides once, below
        new, new_proposal = propose_rows(c_rows, new, st, k_draft)
    big, tree = jax.tree.flatten(state)
    small = tree.flatten_up_to(new)
    out = []
    for x, y, ax in zip(big, small, axes, strict=True):
        if ax is None:
            out.append(x)
            continue
        index = (slice(None),) * ax + (rows_R,)
        out.append(x.at[index].set(y.astype(x.dtype), mode="drop"))
    merged = jax.tree.unflatten(tree, out)._replace(rng=state.rng, r=state.r)
    if not draft_new:
        d = Draft(rng, draft.verify_key, draft.proposal, draft.verify_len, jnp.int32(0))
        return merged, d, host_flags(c, merged, d)
    proposal = jax.tree.map(
        lambda x, y: x.at[rows_R].set(y.astype(x.dtype), mode="drop"),
        draft.proposal,
        new_proposal,
    )
    lens, program = verify_plan(c, merged, proposal, st)
    d = Draft(rng, draft.verify_key, proposal, lens, program)
    return merged, d, host_flags(c, merged, d)


def _bucket(n: int, sizes: Sequence[int]) -> int:
    return next(x for x in sizes if x >= n)


class ContinuousBatcher:
    """Decode a stream of `Request`s on `slots` batch slots with the speculative engine.

    proposer / policy / verify: as the engine's `Static` (e.g. `DSparkProposer`, a fixed
    width or `ScheduledLengths`, "ragged"; `PlainProposer` with policy 0 for plain
    decoding). `gate`: a `SpeculationGate` that turns drafting off while plain decoding is
    measured faster in this loop (None: the policy alone decides). `submit` queues a
    request (refused with a clear error if it cannot fit: prompt + max_new_tokens + the
    drafter's slack > the models' max_seq_len); `step` refills
    free slots and runs one segment, returning the requests that finished; `run` decodes a
    list to the end. `clock` (default `time.perf_counter`) stamps submissions and
    completions; pass `submitted_s` to `submit` for an arrival time of an open-loop trace.
    """

    def __init__(
        self,
        target_params,
        target_cfg: ModelConfig,
        drafter_params,
        proposer,
        *,
        slots: int,
        policy: Any,
        verify: str = "padded",
        buckets: tuple[int, ...] = (),
        compression=None,
        rng: jax.Array | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prompt_width_step: int = 16,
        gate: SpeculationGate | None = None,
    ):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1")
        if verify not in VERIFY_ENGINES:
            raise ValueError(f"verify={verify!r} not in {VERIFY_ENGINES}")
        if verify == "ragged" and not buckets:
            buckets = packed_buckets(slots, proposer.block_size)
        self.st = Static(target_cfg, proposer, 1, policy, verify, tuple(buckets), True)
        self.target_cfg, self.slots, self.clock = target_cfg, slots, clock
        self.seq_len = proposer.seq_len(target_cfg)
        self.width_step = prompt_width_step
        self._params = (nn.unbox(target_params), nn.unbox(drafter_params))
        self._compression = None if compression is None else jnp.asarray(compression, jnp.int32)
        self._rng = jax.random.key(0) if rng is None else rng
        self._queue: collections.deque[tuple[Request, float]] = collections.deque()
        self._slots: list[_Slot | None] = [None] * slots
        self._end = np.zeros(slots, np.int32)  # end 0: a free slot is a finished row
        self._knobs = {f: np.zeros(slots, np.float32) for f in ("temperature", "top_p", "min_p")}
        self._knobs["top_p"][:] = 1.0
        self._top_k = np.zeros(slots, np.int32)
        self._state = self._draft = self._flags = None
        self._axes: dict[int, tuple] = {}
        self._plain_runs = 0  # plain runs in a row (their length doubles)
        self._plain_left = 0  # rounds left in the current plain run
        self._stale = False  # plain rounds ran since the last drafter pass over every row
        self._pos = np.zeros(slots, np.int64)  # each row's position after the last step
        self.gate = gate
        self.segments = {"drafted": 0, "plain": 0}  # segments run, by mode

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request, submitted_s: float | None = None) -> None:
        """Queue `request` (ValueError naming the lengths if it can never fit a slot)."""
        prompt = np.asarray(request.prompt)
        n, v = int(prompt.size), self.target_cfg.vocab_size
        if prompt.ndim != 1 or n < 1 or prompt.dtype.kind not in "iu":
            raise ValueError(f"request {request.request_id!r}: prompt must be >= 1 token ids")
        if prompt.min() < 0 or prompt.max() >= v:
            raise ValueError(
                f"request {request.request_id!r}: prompt ids must lie in [0, vocab_size={v}), "
                f"got [{prompt.min()}, {prompt.max()}]"
            )
        m = request.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"request {request.request_id!r}: max_new_tokens={m!r} must be >= 1")
        slack = self.st.proposer.slack
        if n + m + slack > self.seq_len:
            raise ValueError(
                f"request {request.request_id!r} cannot fit a slot: prompt length {n} + "
                f"max_new_tokens {m} + the drafter's slack {slack} = {n + m + slack} exceeds "
                f"max_seq_len {self.seq_len}"
            )
        for name in ("temperature", "top_k", "top_p", "min_p"):
            if np.ndim(getattr(request.sampling, name)) != 0:
                raise ValueError(
                    f"request {request.request_id!r}: sampling.{name} must be a scalar"
                )
        when = self.clock() if submitted_s is None else submitted_s
        self._queue.append((request, when))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self._slots)

    # ------------------------------------------------------------------ the loop
    def _ctx(self, rows=None) -> Ctx:
        k = self._knobs
        sel = slice(None) if rows is None else rows
        sampling = SamplingParams(
            jnp.asarray(k["temperature"][sel]),
            jnp.asarray(self._top_k[sel]),
            jnp.asarray(k["top_p"][sel]),
            jnp.asarray(k["min_p"][sel]),
        )
        return Ctx(*self._params, sampling, self._compression, jnp.asarray(self._end[sel]))

    def _empty_batch(self):
        """(state, draft, flags) of an empty batch: every slot a finished row."""
        b = self.slots
        prompts, lengths = jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32)
        return host_start(self._ctx(), prompts, lengths, self._rng, self.st)

    def _start(self) -> None:
        self._state, self._draft, self._flags = self._empty_batch()

    def _batch_axes(self, width: int) -> tuple[int | None, ...]:
        """`batch_axes` at a prompt width (computed once per width)."""
        if width not in self._axes:
            self._axes[width] = batch_axes(self._ctx(), self.st, width)
        return self._axes[width]

    def row_buckets(self) -> list[int]:
        """The static row counts of `refill_rows`: every count up to 8, then steps of 25%,
        up to `slots`. A prefill's cost grows with its rows (on a CPU about linearly): under
        load a few rows finish in most rounds, and powers of two padded such a refill by up
        to 2x (1.3x on average), now by at most 1.25x."""
        out = list(range(1, min(8, self.slots) + 1))
        while out[-1] < self.slots:
            out.append(min(max(out[-1] + 1, int(math.ceil(out[-1] * 1.25))), self.slots))
        return out

    def _prompt_width(self, longest: int) -> int:
        """The padded prompt width of a refill whose longest prompt has `longest` tokens."""
        return min(-(-longest // self.width_step) * self.width_step, self.seq_len)

    def programs(self) -> tuple[int, ...]:
        """Every verify program a run can reach (`Draft.program`; 0 a plain segment):
        padded, the policy's width (a fixed int) or every width 0 .. K (a callable);
        ragged, every packed size (and 0 for a callable, which may verify nothing); 0 too
        with a gate, which can turn drafting off under any policy."""
        st, k = self.st, self.st.proposer.block_size
        fixed = isinstance(st.policy, int)
        if st.verify == "ragged":
            out = ((0,) if not fixed else ()) + tuple(x for x in st.buckets if x > 0)
        else:
            out = (st.policy,) if fixed else tuple(range(k + 1))
        return (0, *out) if self.gate is not None and 0 not in out else out

    def precompile(self, prompt_lengths: Iterable[int]) -> int:
        """Compile every program a run with prompts of these lengths can reach, so that no
        timed run compiles: the empty batch's start, `refill_rows` at each row count
        (`row_buckets`) and prompt width (drafting the new rows, and without, when plain
        rounds are reachable), and every verify program (`programs`) with the plain segment
        and the drafter pass after it. They
        run on a throwaway empty batch (every row finished: a verify segment runs no round),
        so the batcher's own state and random stream are untouched; it costs one more batch
        state while it runs. Only while no request is queued or decoding. Returns how many
        programs were run (each compiles once per process)."""
        if self.busy or self._queue:
            raise RuntimeError(
                f"precompile needs an idle batcher: {self.busy} decoding, {self.waiting} queued"
            )
        lengths = sorted({int(n) for n in prompt_lengths})
        if not lengths or lengths[0] < 1 or lengths[-1] + 1 > self.seq_len:
            raise ValueError(
                f"prompt_lengths {lengths} must be >= 1 and leave a slot in max_seq_len "
                f"{self.seq_len}"
            )
        c, run = self._ctx(), 1
        state, draft, flags = self._empty_batch()
        # a refill before a plain round drafts nothing: one more program per size
        variants = (True, False) if 0 in self.programs() else (True,)
        for width in sorted({self._prompt_width(n) for n in lengths}):
            for r, draft_new in itertools.product(self.row_buckets(), variants):
                nowhere = jnp.full((r,), self.slots, jnp.int32)  # every row writes nowhere
                c_rows = self._ctx(np.zeros(r, np.int64))._replace(end_B=jnp.zeros(r, jnp.int32))
                state, draft, flags = refill_rows(
                    c, state, draft, nowhere, jnp.zeros((r, width), jnp.int32),
                    jnp.ones((r,), jnp.int32), c_rows, self.st, self._batch_axes(width),
                    draft_new,
                )  # fmt: skip
                run += 1
        for program in self.programs():
            if program == 0:
                state, draft, flags = plain_segment(c, state, draft, self.st, jnp.int32(1))
                state, draft, flags = host_draft(c, state, self.st)
                run += 1
            else:
                state, draft, flags = host_segment(c, state, draft, self.st, program)
            run += 1
        jax.block_until_ready(flags)
        return run

    def _refill(self, draft_new: bool) -> None:
        """Prefill waiting requests into free slots; `draft_new`: draft them too (False
        when the next round is plain, or every row is drafted again before the next
        drafted round)."""
        free = [i for i, s in enumerate(self._slots) if s is None]
        take = min(len(free), len(self._queue))
        if not take:
            return
        self._stale |= not draft_new
        rows, reqs = free[:take], [self._queue.popleft() for _ in range(take)]
        r_bucket = _bucket(take, self.row_buckets())
        width = self._prompt_width(max(len(r.prompt) for r, _ in reqs))
        prompts = np.zeros((r_bucket, width), np.int32)
        lengths = np.ones(r_bucket, np.int32)
        index = np.full(r_bucket, self.slots, np.int32)  # padding rows write nowhere
        now = self.clock()
        for j, (row, (req, when)) in enumerate(zip(rows, reqs, strict=True)):
            n = len(req.prompt)
            prompts[j, :n], lengths[j], index[j] = req.prompt, n, row
            self._end[row] = n + req.max_new_tokens
            s = req.sampling
            self._knobs["temperature"][row] = s.temperature
            self._top_k[row] = s.top_k
            self._knobs["top_p"][row], self._knobs["min_p"][row] = s.top_p, s.min_p
            self._slots[row] = _Slot(req, when, now)
        sel = np.minimum(index, self.slots - 1)
        c_rows = self._ctx(sel)._replace(
            end_B=jnp.asarray(np.where(index < self.slots, self._end[sel], 0))
        )
        # device_put, not jnp.asarray: that compiles a staging program per 2-D shape
        index, prompts, lengths = jax.device_put((index, prompts, lengths))
        self._state, self._draft, self._flags = refill_rows(
            self._ctx(), self._state, self._draft, index, prompts, lengths, c_rows, self.st,
            self._batch_axes(width), draft_new,
        )  # fmt: skip
        for row, (req, _) in zip(rows, reqs, strict=True):
            self._pos[row] = len(req.prompt)  # the pending token: sampled at the prefill

    def _draft_all(self, c: Ctx) -> int:
        """A drafter pass over every row and the policy's decision (`host_draft`); returns
        the program it chose. Its keys come from the current draft's `rng` (never used:
        `state.rng` may already have fed a refill since the last round). Its seconds count
        for neither mode: it is the price of switching, which the probes keep rare."""
        state = self._state._replace(rng=self._draft.rng)
        self._state, self._draft, self._flags = host_draft(c, state, self.st)
        self._stale = False
        return int(jax.device_get(self._flags)[0])

    def step(self) -> list[Completion]:
        """Refill free slots from the queue, run one segment; the requests that finished."""
        if self._state is None:
            self._start()
        gate_plain = self.gate is not None and (
            not self.gate.speculate() or self.gate.probe_plain()
        )
        plain_next = bool(self._plain_left) or gate_plain  # known before the policy's plan
        self._refill(draft_new=not plain_next and not self._stale)
        program, more, r0 = (int(x) for x in jax.device_get(self._flags))
        if not more:  # nothing to decode (or every new request is done at its prefill)
            return self._collect(np.asarray(jax.device_get(self._state.pos)))
        c = self._ctx()
        if not plain_next and self._stale:
            # the last drafter pass predates plain rounds or refills: draft every row first
            program = self._draft_all(c)
        start = self.clock()
        if plain_next or program == 0:
            mode = "plain"
            if not self._plain_left:  # a new run: 1, 2, 4, .. rounds while plain is chosen
                self._plain_left = min(2**self._plain_runs, MAX_PLAIN_ROUNDS)
                self._plain_runs += 1
            out = plain_segment(c, self._state, self._draft, self.st, jnp.int32(self._plain_left))
        else:
            mode = "drafted"
            self._plain_runs = 0
            out = host_segment(c, self._state, self._draft, self.st, program)
        self._state, self._draft, self._flags = out
        rounds = int(jax.device_get(self._flags)[2]) - r0
        seconds = self.clock() - start
        if mode == "plain":
            self._plain_left -= rounds
            self._stale = True
            if not self._plain_left and (self.gate is None or self.gate.speculate()):
                self._draft_all(c)  # the policy decides the next round (not timed)
        pos = np.asarray(jax.device_get(self._state.pos))
        self.segments[mode] += 1
        if self.gate is not None and rounds:
            busy = np.asarray([s is not None for s in self._slots])
            tokens = np.minimum(pos + 1, self._end) - np.minimum(self._pos + 1, self._end)
            # a clock too coarse to see the segment: the smallest positive time instead
            seconds = max(seconds, np.finfo(np.float64).tiny)
            self.gate.record(mode, int(tokens[busy].sum()), seconds, rounds)
        return self._collect(pos)

    def _collect(self, pos: np.ndarray) -> list[Completion]:
        self._pos[:] = pos
        done = [
            i for i, s in enumerate(self._slots) if s is not None and pos[i] + 1 >= self._end[i]
        ]
        if not done:
            return []
        now = self.clock()
        # whole arrays to the host, then the rows: indexing on device would compile a
        # gather for every count of finished rows
        history = np.asarray(jax.device_get(self._state.history))[np.asarray(done)]
        tally = np.asarray(jax.device_get(self._state.tally))[:, np.asarray(done)]
        out = []
        for j, row in enumerate(done):
            slot = self._slots[row]
            n, m = len(slot.request.prompt), slot.request.max_new_tokens
            out.append(
                Completion(
                    slot.request.request_id, history[j, n : n + m].copy(), int(tally[0, j]),
                    int(tally[1, j]), int(tally[2, j]), slot.submitted_s, slot.started_s, now,
                )
            )  # fmt: skip
            self._slots[row], self._end[row] = None, 0
        return out

    def cancel(self) -> int:
        """Drop every queued request and stop every decoding one (nothing is returned for
        them; their slots are free for the next requests). Returns how many were dropped."""
        dropped = len(self._queue) + self.busy
        self._queue.clear()
        self._slots = [None] * self.slots
        self._end[:] = 0  # a free slot is a finished row: the next segment skips it
        return dropped

    def reset(self) -> int:
        """`cancel`, and drop the batch state too (its device memory: the caches of every
        slot); the next `step` starts an empty batch, on the random stream's next key. The
        gate keeps what it measured. Returns how many requests were dropped."""
        dropped = self.cancel()
        if self._state is not None:
            self._rng = jax.random.split(self._draft.rng)[0]
        self._state = self._draft = self._flags = None
        self._plain_left = self._plain_runs = 0
        self._stale = False
        return dropped

    def run(self, requests: Iterable[Request]) -> list[Completion]:
        """Submit every request now and decode until all are done (completion order)."""
        for r in requests:
            self.submit(r)
        out: list[Completion] = []
        while self._queue or self.busy:
            out += self.step()
        return out
