"""The speculative-decoding engine: one round (draft step, verify step, rollback), any drafter.

A drafter is a `Proposer` (a hashable plug-in: a small model, `v41jax.decode.speculative`; the
DSpark drafter, `v41jax.dspark.decode.rounds`); the engine owns everything else: the target, the
history, positions, sampling, verification and the loops.

State per row b: `history[b]` (prompt and emitted tokens by slot) and `pos[b]`, the slot of the
pending token (emitted, not yet fed to the target), so the target's KV cache holds slots < pos.
One round, all rows at once with per-row acceptance:

  1. `draft_step`: the proposer drafts d_1 .. d_K with their exact laws q_k and confidences
     c [B, K]; the width policy picks the verify width w in [0, K] from draft-side
     information only (a fixed int, or e.g. the DSpark scheduler), so the output law is kept;
  2. `verify_step(width=w)`: the target extends [pending, d_1 .. d_w] at slot pos (a static
     width: one compiled step per w) and `speculative_sample` accepts A <= w drafts and emits
     one more token (w = 0: a plain decode step, the drafts are dropped); the proposer sees
     the target's output (`observe`); pos += A + 1.
Rollback is free: slots >= pos hold stale entries that causality never lets a query see, and
the next round overwrites them. Both models sample with the same settings (`probs_fn`),
which is what makes the output exact: distributed as `generate`'s, token for token equal at
temperature 0.

Two verify engines (`Static.verify`):
  "padded": one width w for the batch; every active row verifies w drafts in a [B, 1 + w]
    call, so a round costs B (1 + w) tokens whatever each row needed.
  "ragged": each row its own length L_b in [0, K] (the policy returns them, [B]); the
    target runs once over the packed tokens of the active rows, sum_b (1 + L_b) of them,
    padded up to the smallest of a few static sizes (`Static.buckets`, one compiled program
    each; `packed_buckets`), each token attending to its own row's cache at its own slot
    (`v41jax.model.attention.PackedRows`). Its cost follows the packed count. A round where
    every active row verifies 0 drafts is a plain round (program 0, below). Host loop only.

Two loops run rounds: `device_loop` (one `lax.while_loop` at a fixed width) and `host_loop`
(a Python loop over segments: one compiled program per width that keeps running rounds while
the policy keeps choosing that width; width 0 runs a segment of plain decode steps without
drafting, 1, 2, 4, .. up to `MAX_PLAIN_ROUNDS` rounds as long as the policy keeps choosing it,
so that drafting only to decide "no drafts" costs little).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, get_args

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.decode.generate import init_cache, window_ending_at
from v41jax.decode.sampling import SamplingParams, probs_fn, sample_probs
from v41jax.engram import ngram_hash_ids_step
from v41jax.model.attention import PackedRows, pack_rows
from v41jax.model.transformer import Transformer, engram_ids_key
from v41jax.speculative import speculative_sample

# Longest run of plain rounds between two drafter passes when the policy keeps choosing
# width 0; the run doubles from 1 at each consecutive "no drafts" decision.
MAX_PLAIN_ROUNDS = 32


class Proposal(NamedTuple):
    """A round's drafts: drafts int32 [B, K], q float32 [B, K, V] (the exact law each draft was
    sampled from), confidence float32 [B, K] (estimated conditional acceptance; zeros for a
    proposer without a confidence head)."""

    drafts: jax.Array
    q: jax.Array
    confidence: jax.Array


class Proposer(Protocol):
    """A drafter plug-in: hashable (a jit static argument), pure functions of its state.

    block_size: K. slack: positions it needs beyond prompt + new tokens. hidden_layers: target
    layers whose outputs it reads (`ModelOutput.hidden`, prefill and verify).
    """

    block_size: int
    slack: int
    hidden_layers: tuple[int, ...]

    def seq_len(self, target_cfg: ModelConfig) -> int:
        """Slots the history may use (the smaller of every model's max_seq_len)."""

    def init(self, params, target_out, prompts_BxP, lengths_B, compression) -> Any:
        """The drafter's state after the prompts; target_out: the target's prefill output."""

    def propose(self, params, dstate, history_BxS, pos_B, active_B, key, probs, compression):
        """(Proposal, new drafter state): drafts following the pending token at pos."""

    def observe(self, params, dstate, history_BxS, target_out, start_B, compression) -> Any:
        """The drafter's state after the target extended t slots from start (t = w + 1)."""


Verify = Literal["padded", "ragged"]
VERIFY_ENGINES: tuple[Verify, ...] = get_args(Verify)


def packed_buckets(batch_size: int, block_size: int, ratio: float = 1.25) -> tuple[int, ...]:
    """The static packed sizes of the ragged engine for B rows and K drafts: 1 .. 8, then
    sizes growing by `ratio` (rounded up, to a multiple of 8 past 64), and B (1 + K), the
    largest round. A round of t tokens runs at the smallest size >= t, so it pads by less
    than `ratio` - 1 of its tokens; a larger ratio compiles fewer programs."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 1:
        raise ValueError(f"bucket ratio={ratio!r} must be a number > 1")
    top = batch_size * (1 + block_size)
    sizes, x = set(range(1, min(8, top) + 1)), 8
    while x < top:
        x = max(int(np.ceil(x * ratio)), x + 1)
        x = -(-x // 8) * 8 if x > 64 else x
        sizes.add(min(top, x))
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class Static:
    """What fixes the compiled shapes and branches (hashable: a jit static argument).

    policy: an int (a fixed width in [1, K]) or a hashable callable
    `(confidence [B, K], active [B] bool, useful [B] int32) -> width int32 []` in [0, K] that
    reads draft-side information only (`useful`: drafts a row can still use). With
    verify "ragged" a callable returns the per-row lengths int32 [B] in [0, K] instead (an
    int L verifies L drafts in every active row). buckets: the packed sizes of the ragged
    engine (default `packed_buckets(B, K)`, filled in by the loop). stop_on_finish: a host
    segment also ends when a row finishes (continuous batching refills it,
    `v41jax.decode.batching`)."""

    target_cfg: ModelConfig
    proposer: Any
    max_new_tokens: int
    policy: Any
    verify: Verify = "padded"
    buckets: tuple[int, ...] = ()
    stop_on_finish: bool = False


class Ctx(NamedTuple):
    """Per-call constants: parameters, sampling settings (`SamplingParams.as_arrays`), Engram
    compression, end slots [B]."""

    target_params: Any
    drafter_params: Any
    sampling: SamplingParams
    compression: Any
    end_B: jax.Array  # a row is done once pos + 1 >= end


class State(NamedTuple):
    """The loop carry. logs: confidence [R, B, K], verify_len / accepted [R, B] int32,
    active [R, B] bool, R = max_new_tokens (every round emits >= 1 token per active row;
    rounds past R are not logged). tally int32 [3, B]: per row, the rounds it took part in,
    the drafts it verified and the drafts accepted (since its prefill)."""

    r: jax.Array
    rng: jax.Array
    target_kv: Any
    drafter_state: Any
    history: jax.Array
    pos: jax.Array
    logs: tuple
    tally: jax.Array


class Draft(NamedTuple):
    """A round's draft side: the proposal, the verify key, verify_len int32 [B] and the
    round's program int32 []: which compiled verify runs it (padded: the width the policy
    chose; ragged: the packed size, 0 for a plain round)."""

    rng: jax.Array
    verify_key: jax.Array
    proposal: Proposal
    verify_len: jax.Array
    program: jax.Array


class EngineOutput(NamedTuple):
    """tokens int32 [B, N]; rounds int32 [B]; the per-round log, R = N rounds at most:
    confidence float32 [R, B, K], verify_len int32 [R, B], accepted int32 [R, B], active bool
    [R, B] (row still generating in that round)."""

    tokens: jax.Array
    rounds: jax.Array
    confidence: jax.Array
    verify_len: jax.Array
    accepted: jax.Array
    active: jax.Array


# ----------------------------------------------------------------------------- target calls
def _engram_extras_at(cfg: ModelConfig, compressed_BxS, start_B, t: int) -> dict:
    """Hash ids of the t tokens at positions start .. start+t-1, from the history."""
    if not cfg.engram.enabled:
        return {}
    windows = [window_ending_at(cfg, compressed_BxS, start_B + i) for i in range(t)]
    return {
        engram_ids_key(layer): jnp.stack(
            [ngram_hash_ids_step(w, layer, cfg.engram) for w in windows], axis=1
        )
        for layer in cfg.engram.layer_ids
    }


def extend_output(
    params,
    cfg: ModelConfig,
    kv,
    history_BxS,
    start_B,
    t: int,
    compression=None,
    hidden_layers: tuple[int, ...] = (),
):
    """Feed history[start .. start+t-1] (per row) through the cache at those slots.

    Returns the `ModelOutput` (logits [B, t, V], `hidden_layers`' outputs [B, t, D], the
    updated caches). Engram ids are hashed from the history, so a rolled-back row needs no
    window state.
    """
    idx_BxT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)
    tokens_BxT = jnp.take_along_axis(history_BxS, idx_BxT, axis=1)
    extras = {}
    if cfg.engram.enabled:
        extras = _engram_extras_at(cfg, compression[history_BxS], start_B, t)
    return Transformer(cfg).apply(
        {"params": params},
        tokens_BxT,
        idx_BxT,
        cache=kv,
        cache_index=start_B,
        extras=extras,
        hidden_layers=hidden_layers,
    )


def extend_packed(
    params,
    cfg: ModelConfig,
    kv,
    history_BxS,
    packed: PackedRows,
    compression=None,
    hidden_layers: tuple[int, ...] = (),
):
    """`extend_output` for packed rows: feed history[row_N, slot_N] (N tokens of the cache's
    rows, `pack_rows`) through the cache. Returns the `ModelOutput` over [1, N]: logits
    [1, N, V], hidden [1, N, D], the updated caches."""
    b = history_BxS.shape[0]
    row_N = jnp.minimum(packed.row_N, b - 1)
    tokens_1xN = history_BxS[row_N, packed.slot_N][None]
    extras = {}
    if cfg.engram.enabled:
        window_NxM = window_ending_at(cfg, compression[history_BxS], packed.slot_N, row_N)
        extras = {
            engram_ids_key(layer): ngram_hash_ids_step(window_NxM, layer, cfg.engram)[None]
            for layer in cfg.engram.layer_ids
        }
    return Transformer(cfg).apply(
        {"params": params},
        tokens_1xN,
        cache=kv,
        extras=extras,
        hidden_layers=hidden_layers,
        packed=packed,
    )


def write_history(history_BxS, start_B, values_BxT, mask_BxT):
    """history[b, start+t] = values[b, t] where mask (positions past S are dropped)."""
    b, t = values_BxT.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    cols = jnp.where(mask_BxT, start_B[:, None] + jnp.arange(t), history_BxS.shape[1])
    return history_BxS.at[rows, cols].set(values_BxT, mode="drop")


def check_prompt_batch(prompt_shape, lengths, n_new: int) -> None:
    """Right-padded prompts [B, P] with lengths [B] in [1, P], and max_new_tokens >= 1."""
    if n_new < 1:
        raise ValueError(f"max_new_tokens={n_new} must be >= 1")
    if len(prompt_shape) != 2 or np.shape(lengths) != prompt_shape[:1]:
        raise ValueError(f"prompts must be [B, P] with lengths [B], got {prompt_shape}")
    lengths = np.asarray(lengths)
    if lengths.min() < 1 or lengths.max() > prompt_shape[1]:
        raise ValueError(f"prompt_lengths {lengths.tolist()} must lie in [1, P={prompt_shape[1]}]")


# ----------------------------------------------------------------------------- the round
def prefill(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> State:
    """The prompts through the target and the proposer, and the first new token sampled
    from the target at each row's last prompt position."""
    cfg, prop = st.target_cfg, st.proposer
    b, p_width = prompts_BxP.shape
    history = jnp.zeros((b, prop.seq_len(cfg)), jnp.int32).at[:, :p_width].set(prompts_BxP)
    out = extend_output(
        c.target_params,
        cfg,
        init_cache(cfg, b),
        history,
        jnp.zeros((b,), jnp.int32),
        p_width,
        c.compression,
        prop.hidden_layers,
    )
    dstate = prop.init(c.drafter_params, out, prompts_BxP, lengths_B, c.compression)
    rng, key = jax.random.split(rng)
    last = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    first = sample_probs(key, probs_fn(c.sampling)(last.astype(jnp.float32)))
    history = write_history(history, lengths_B, first[:, None], lengths_B[:, None] >= 0)
    n, k = st.max_new_tokens, prop.block_size
    logs = (
        jnp.zeros((n, b, k), jnp.float32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), bool),
    )
    tally = jnp.zeros((3, b), jnp.int32)
    return State(jnp.int32(0), rng, out.cache, dstate, history, lengths_B, logs, tally)


def active_rows(c: Ctx, state: State) -> jax.Array:
    """bool [B]: rows still generating (the pending token's slot is before the row's end)."""
    return state.pos + 1 < c.end_B


def any_active(c: Ctx, state: State) -> jax.Array:
    return jnp.any(active_rows(c, state))


def draft_step(c: Ctx, state: State, st: Static) -> tuple[State, Draft]:
    """Step 1 of the round: the proposal and the verify width."""
    rng, k_draft, k_verify = jax.random.split(state.rng, 3)
    state, proposal = propose_rows(c, state, st, k_draft)
    lens, program = verify_plan(c, state, proposal, st)
    return state, Draft(rng, k_verify, proposal, lens, program)


def propose_rows(c: Ctx, state: State, st: Static, key) -> tuple[State, Proposal]:
    """The proposer's drafts for every row of `state` (the policy not consulted), and the
    state with the drafter's new state."""
    proposal, dstate = st.proposer.propose(
        c.drafter_params,
        state.drafter_state,
        state.history,
        state.pos,
        state.pos + 1 < c.end_B,
        key,
        probs_fn(c.sampling),
        c.compression,
    )
    return state._replace(drafter_state=dstate), proposal


def verify_plan(c: Ctx, state: State, proposal: Proposal, st: Static):
    """(verify_len int32 [B], program int32 []): the policy's lengths for this proposal
    (draft-side information only: confidences, active rows, useful drafts) and the compiled
    verify that runs them."""
    k = st.proposer.block_size
    active = state.pos + 1 < c.end_B
    # drafts past a row's last needed token add nothing: pos + 1 + j <= end - 1
    useful = jnp.clip(c.end_B - 2 - state.pos, 0, k).astype(jnp.int32)
    if st.verify == "ragged":
        if isinstance(st.policy, int):
            lens = jnp.full(active.shape, st.policy, jnp.int32)
        else:
            lens = jnp.asarray(st.policy(proposal.confidence, active, useful), jnp.int32)
        lens = jnp.where(active, jnp.clip(lens, 0, k), 0).astype(jnp.int32)
        return lens, ragged_program(jnp.where(active, 1 + lens, 0), lens, active, st.buckets)
    if isinstance(st.policy, int):
        width = jnp.int32(st.policy)
    else:
        width = jnp.asarray(st.policy(proposal.confidence, active, useful), jnp.int32)
    # A padded verify costs the same for every row, so every active row verifies `width`.
    return jnp.where(active, width, 0).astype(jnp.int32), width


def bucket_ceil(tokens, buckets: tuple[int, ...]):
    """The smallest bucket >= tokens (numpy or jnp ints; tokens <= the largest bucket)."""
    xp = jnp if isinstance(tokens, jax.Array) else np
    table = xp.asarray(buckets)
    return table[xp.minimum(xp.searchsorted(table, tokens, side="left"), len(buckets) - 1)]


def ragged_program(counts_B, lens_B, active_B, buckets: tuple[int, ...]) -> jax.Array:
    """The ragged round's program, int32 []: the smallest bucket >= sum(counts), or 0 (a
    plain round) when no active row verifies a draft."""
    size = bucket_ceil(jnp.sum(counts_B), buckets)
    drafting = jnp.any(active_B & (lens_B > 0))
    return jnp.where(drafting, size, 0).astype(jnp.int32)


def _advance(c: Ctx, state: State, st: Static, o, emitted, acc, confidence, lens, rng) -> State:
    """Write the emitted tokens, let the proposer observe, move pos, log the round."""
    active = state.pos + 1 < c.end_B
    history = write_history(state.history, state.pos + 1, emitted, active[:, None] & (emitted >= 0))
    dstate = st.proposer.observe(
        c.drafter_params, state.drafter_state, history, o, state.pos, c.compression
    )
    pos = jnp.where(active, state.pos + acc + 1, state.pos)
    c_log, l_log, a_log, act_log = state.logs
    r = state.r
    logs = (
        c_log.at[r].set(confidence),
        l_log.at[r].set(lens),
        a_log.at[r].set(acc),
        act_log.at[r].set(active),
    )
    tally = state.tally + jnp.where(active, jnp.stack([jnp.ones_like(lens), lens, acc]), 0)
    return State(r + 1, rng, o.cache, dstate, history, pos, logs, tally)


def verify_step(c: Ctx, state: State, d: Draft, st: Static, program: int) -> State:
    """Step 2 of the round with a static program (d.program == program): padded, the width
    (0 <= width <= K); ragged, the packed size (0: a plain round)."""
    cfg, prop = st.target_cfg, st.proposer
    k = prop.block_size
    if program == 0:
        return _plain_round(c, state, st, d.verify_key, d.rng, d.proposal.confidence)
    if st.verify == "ragged":
        return _ragged_verify(c, state, d, st, program)
    width = program
    active = state.pos + 1 < c.end_B
    p = d.proposal
    hist_d = write_history(state.history, state.pos + 1, p.drafts, active[:, None])
    o = extend_output(
        c.target_params,
        cfg,
        state.target_kv,
        hist_d,
        state.pos,
        width + 1,
        c.compression,
        prop.hidden_layers,
    )
    pad = k - width  # speculative_sample takes [B, K + 1] logits; columns past L are unread
    logits = jnp.concatenate([o.logits] + [o.logits[:, -1:]] * pad, axis=1).astype(jnp.float32)
    emitted, acc = speculative_sample(
        d.verify_key, p.drafts, p.q, probs_fn(c.sampling)(logits), d.verify_len
    )
    return _advance(c, state, st, o, emitted, acc, p.confidence, d.verify_len, d.rng)


def _ragged_verify(c: Ctx, state: State, d: Draft, st: Static, n: int) -> State:
    """Verify each active row's [pending, d_1 .. d_{L_b}] packed into n tokens; the outputs
    are unpacked to [B, K + 1] (columns past a row's L_b are zeros, never read)."""
    cfg, prop = st.target_cfg, st.proposer
    k = prop.block_size
    active = state.pos + 1 < c.end_B
    p = d.proposal
    hist_d = write_history(state.history, state.pos + 1, p.drafts, active[:, None])
    counts = jnp.where(active, d.verify_len + 1, 0)
    packed = pack_rows(counts, state.pos, n, k + 1)
    o = extend_packed(
        c.target_params, cfg, state.target_kv, hist_d, packed, c.compression, prop.hidden_layers
    )
    o = o._replace(
        logits=packed.to_rows(o.logits[0]),
        hidden={layer: packed.to_rows(h[0]) for layer, h in o.hidden.items()},
    )
    emitted, acc = speculative_sample(
        d.verify_key,
        p.drafts,
        p.q,
        probs_fn(c.sampling)(o.logits.astype(jnp.float32)),
        d.verify_len,
    )
    return _advance(c, state, st, o, emitted, acc, p.confidence, d.verify_len, d.rng)


def _plain_round(c: Ctx, state: State, st: Static, key, rng, confidence) -> State:
    """A round with no drafts: one plain decode step of the target (and the proposer's
    `observe` of that slot)."""
    o = extend_output(
        c.target_params,
        st.target_cfg,
        state.target_kv,
        state.history,
        state.pos,
        1,
        c.compression,
        st.proposer.hidden_layers,
    )
    tok = sample_probs(key, probs_fn(c.sampling)(o.logits[:, 0].astype(jnp.float32)))
    b = state.pos.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    return _advance(c, state, st, o, tok[:, None], zeros, confidence, zeros, rng)


def plain_step(c: Ctx, state: State, st: Static) -> State:
    """A round without drafting (the keys a drafted round would use; confidences logged 0)."""
    rng, _, k_verify = jax.random.split(state.rng, 3)
    b, k = state.pos.shape[0], st.proposer.block_size
    return _plain_round(c, state, st, k_verify, rng, jnp.zeros((b, k), jnp.float32))
