"""The loops that run speculative rounds (`v41jax.decode.engine`).

- device (a fixed width): the whole generation is one `lax.while_loop`;
- host (any policy): a Python loop over segments. One compiled program per width runs rounds
  while the policy keeps choosing that width (a `lax.while_loop`), the state (both caches,
  history, logs) donated from call to call; at a change the width is read back and the
  matching program is dispatched, so each width costs what it costs. (A `lax.switch` over
  the widths inside the device loop carries the KV caches through the conditional and XLA
  copies them in and out on every round.) Width 0 ("no drafts") runs plain decode steps
  without a drafter pass, 1, 2, 4, .. `MAX_PLAIN_ROUNDS` of them while the policy keeps
  choosing 0 at the drafter pass that ends each run (`plain_segment`, then `host_draft`):
  the decision to skip drafting depends only on earlier rounds, so the output law is kept.
  `plain_segment` hands back a draft that carries only the keys of the next plain round
  (`plain_draft`), so a host whose run stopped early (a row finished, with
  `Static.stop_on_finish`) can refill and go on with it without a drafter pass
  (`v41jax.decode.batching`).
Both loops give the same tokens for the same rng at a fixed width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from v41jax.decode.engine import (
    MAX_PLAIN_ROUNDS,
    VERIFY_ENGINES,
    Ctx,
    Draft,
    EngineOutput,
    State,
    Static,
    active_rows,
    any_active,
    draft_step,
    packed_buckets,
    plain_step,
    prefill,
    verify_step,
)

Loop = Literal["device", "host"]
LOOPS: tuple[Loop, ...] = get_args(Loop)


def finish(lengths_B, state: State, st: Static) -> EngineOutput:
    c_log, l_log, a_log, act_log = state.logs
    idx = lengths_B[:, None] + jnp.arange(st.max_new_tokens)
    tokens = jnp.take_along_axis(state.history, idx, axis=1)
    rounds = act_log.sum(0).astype(jnp.int32)
    return EngineOutput(tokens, rounds, c_log, l_log, a_log, act_log)


_finish_jit = jax.jit(finish, static_argnames=("st",))


@functools.partial(jax.jit, static_argnames=("st",))
def device_loop(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> EngineOutput:
    """Every round at the fixed width `st.policy` (an int), in one `lax.while_loop`."""

    def one_round(state):
        state, d = draft_step(c, state, st)
        return verify_step(c, state, d, st, st.policy)

    state = prefill(c, prompts_BxP, lengths_B, rng, st)
    state = jax.lax.while_loop(lambda s: any_active(c, s), one_round, state)
    return finish(lengths_B, state, st)


def none_finished(c: Ctx, state: State, st: Static, started_B) -> jax.Array:
    """With `st.stop_on_finish`: no row active at the segment's start has finished (else
    True: segments run on)."""
    if not st.stop_on_finish:
        return jnp.bool_(True)
    return jnp.all(active_rows(c, state) | ~started_B)


def host_flags(c: Ctx, state: State, d: Draft) -> jax.Array:
    """[next width, any row active, rounds run so far]: the ints the host reads after each
    program (the round counter lets it count a segment's rounds)."""
    return jnp.stack([d.program, any_active(c, state).astype(jnp.int32), state.r])


def draft_with_flags(c: Ctx, state: State, st: Static):
    """The round's draft side and its `host_flags`."""
    state, d = draft_step(c, state, st)
    return state, d, host_flags(c, state, d)


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("state",))
def host_draft(c: Ctx, state: State, st: Static):
    """The next round's draft side after a plain run (`plain_segment`): a drafter pass and
    the policy's decision."""
    return draft_with_flags(c, state, st)


def plain_draft(state: State, d: Draft) -> Draft:
    """A draft that verifies nothing and carries the keys `plain_step` would use next:
    `plain_segment` starting from it runs the plain rounds an unbroken run would have (with
    nothing between them; a refill splits its `rng` further). Its proposal, `d`'s, is never
    verified by a width-0 round (its confidences are only logged)."""
    rng, _, k_verify = jax.random.split(state.rng, 3)
    return Draft(rng, k_verify, d.proposal, jnp.zeros_like(d.verify_len), jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("st",))
def host_start(c: Ctx, prompts_BxP, lengths_B, rng, st: Static):
    return draft_with_flags(c, prefill(c, prompts_BxP, lengths_B, rng, st), st)


# One program per width that keeps going while the policy keeps choosing that width: a run
# of rounds at one width costs one launch and one sync, not one per round.
# (program: the padded width, or the ragged engine's packed size)
@functools.partial(jax.jit, static_argnames=("st", "program"), donate_argnames=("state",))
def host_segment(c: Ctx, state: State, d: Draft, st: Static, program: int):
    started = active_rows(c, state)

    def same_program(carry):
        state, d = carry
        return any_active(c, state) & (d.program == program) & none_finished(c, state, st, started)

    def one_round(carry):
        state, d = carry
        return draft_step(c, verify_step(c, state, d, st, program), st)

    state, d = jax.lax.while_loop(same_program, one_round, (state, d))
    return state, d, host_flags(c, state, d)


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("state",))
def plain_segment(c: Ctx, state: State, d: Draft, st: Static, n_rounds):
    """This round without its drafts (width 0), then up to n_rounds - 1 plain decode rounds
    with no drafter pass (fewer when a row finishes, with `st.stop_on_finish`). Returns
    (state, `plain_draft`, flags): no drafter pass here; the host calls `host_draft` when
    the run is over, or goes on with another plain segment from the returned draft.
    n_rounds: int32 [] >= 1 (traced: one program for every run length)."""
    started = active_rows(c, state)
    state = verify_step(c, state, d, st, 0)

    def more(carry):
        state, i = carry
        return any_active(c, state) & (i < n_rounds) & none_finished(c, state, st, started)

    state, _ = jax.lax.while_loop(
        more, lambda s: (plain_step(c, s[0], st), s[1] + 1), (state, jnp.int32(1))
    )
    d = plain_draft(state, d)
    return state, d, host_flags(c, state, d)


def host_loop(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> EngineOutput:
    """Segments of rounds at one width until every row is done; the draft after the last
    round is computed and discarded (one drafter pass). Each call donates its state."""
    state, d, flags = host_start(c, prompts_BxP, lengths_B, rng, st)
    zeros_in_a_row = 0
    while True:
        program, more, _ = (int(x) for x in jax.device_get(flags))
        if not more:
            return _finish_jit(lengths_B, state, st)
        if program == 0:
            n = min(2**zeros_in_a_row, MAX_PLAIN_ROUNDS)
            zeros_in_a_row += 1
            state, d, _ = plain_segment(c, state, d, st, jnp.int32(n))
            state, d, flags = host_draft(c, state, st)
        else:
            zeros_in_a_row = 0
            state, d, flags = host_segment(c, state, d, st, program)


def run_rounds(c: Ctx, prompts_BxP, lengths_B, rng, st: Static, loop: Loop) -> EngineOutput:
    """The generation on `loop` ("device" needs a fixed int policy)."""
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} not in {LOOPS}")
    if st.verify not in VERIFY_ENGINES:
        raise ValueError(f"verify={st.verify!r} not in {VERIFY_ENGINES}")
    if st.verify == "ragged":
        if loop == "device":
            raise ValueError("verify='ragged' picks a packed size per round: it needs loop='host'")
        if not st.buckets:
            b, k = prompts_BxP.shape[0], st.proposer.block_size
            st = dataclasses.replace(st, buckets=packed_buckets(b, k))
        return host_loop(c, prompts_BxP, lengths_B, rng, st)
    if loop == "device":
        if not isinstance(st.policy, int):
            raise ValueError(
                "loop='device' runs one static verify width; a policy needs loop='host'"
            )
        return device_loop(c, prompts_BxP, lengths_B, rng, st)
    return host_loop(c, prompts_BxP, lengths_B, rng, st)
