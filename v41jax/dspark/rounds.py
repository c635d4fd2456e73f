"""One DSpark decode round, as pure functions shared by the engine's two loops (engine.py).

State per row b: `history[b]` (prompt and emitted tokens by slot), `pos[b]` the slot of the
pending token (emitted, not yet fed to the target). The target's KV cache holds slots < pos;
the drafter's context cache holds, per drafter layer, the K/V of the target features of
slots < pos (`Drafter.context_kv`, written once per accepted position). One round:

  1. `draft_step`: one drafter pass over the block [pending, mask x (K-1)] at slots
     pos .. pos+K-1, attending to context slots [pos - window, pos); the Markov head then
     samples d_1 .. d_K sequentially (`markov_draft`), returning q_k, the exact law of d_k.
     The verify width w is K' ("fixed") or chosen from the confidences alone ("scheduled",
     `schedule_verify_lengths`, `ENGINE_BASIS`, on the measured round-cost table). Confidences
     come from the drafter's pass before any draft is sampled, so w never depends on the
     target or on the sampled drafts and the output law is unchanged (see
     `v41jax.speculative.pipeline_audit`);
  2. `verify_step(width=w)`: the target extends [pending, d_1 .. d_w] at slot pos (a static
     width: one compiled step per w); `speculative_sample(key, d, q, p, L)` with L_b = w for
     active rows (0 for finished ones) gives A_b accepted drafts and one more token; the
     target features of slots pos .. pos+A go into the drafter's context cache; pos += A+1.
Rollback is free: slots >= pos hold stale entries that no query can see, and the next round
overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from v41jax.config import ModelConfig
from v41jax.dspark.config import DrafterConfig
from v41jax.dspark.drafter import Drafter
from v41jax.dspark.markov import markov_draft
from v41jax.dspark.scheduler import CostTable, schedule_verify_lengths
from v41jax.model.attention import update_cache
from v41jax.model.generate import init_cache
from v41jax.model.sampling import knob_probs, sample_probs
from v41jax.model.speculative import _write, extend_output
from v41jax.speculative import speculative_sample

# One verify width per round for the whole padded batch: the scheduler prices exactly that
# (basis "width": every active row's first w drafts count), not the ragged budget rule.
ENGINE_BASIS = "width"


def scheduled_width(
    conf_BxK, cost: CostTable, active_B, useful_B=None, basis=ENGINE_BASIS, **kw
) -> jax.Array:
    """The round's verify width, int32 scalar: the largest of the scheduler's lengths over the
    active rows (1 if none is active); `kw` go to `schedule_verify_lengths`."""
    sched = schedule_verify_lengths(
        conf_BxK, cost, basis=basis, active_B=active_B, useful_B=useful_B, **kw
    )
    return jnp.max(jnp.where(active_B, sched.verify_len, 1))


@dataclass(frozen=True)
class Static:
    """Everything that fixes the compiled shapes and branches (hashable: a jit static arg)."""

    target_cfg: ModelConfig
    drafter: DrafterConfig
    max_new_tokens: int
    mode: str  # "fixed" | "scheduled"
    fixed_len: int  # the verify width of mode "fixed"
    cost: CostTable | None  # round cost per B * (1 + w) tokens, mode "scheduled"


class Ctx(NamedTuple):
    """Per-call constants: parameters, sampling knobs, Engram compression, end slots [B]."""

    target_params: Any
    drafter_params: Any
    frozen: Any
    knobs: Any
    compression: Any
    end_B: jax.Array  # a row is done once pos + 1 >= end


class State(NamedTuple):
    """The loop carry. logs: confidence [R, B, K], verify_len / accepted [R, B] int32,
    active [R, B] bool, R = max_new_tokens (every round emits >= 1 token per active row)."""

    r: jax.Array
    rng: jax.Array
    target_kv: Any
    context_kv: Any
    history: jax.Array
    pos: jax.Array
    logs: tuple


class Draft(NamedTuple):
    """A round's draft-side result: drafts int32 [B, K], q float32 [B, K, V], confidence
    float32 [B, K], verify_len int32 [B], width int32 scalar (max verify_len, >= 1)."""

    rng: jax.Array
    verify_key: jax.Array
    drafts: jax.Array
    q: jax.Array
    confidence: jax.Array
    verify_len: jax.Array
    width: jax.Array


def _layer_ids(st: Static):
    return st.drafter.layer_ids_for(st.target_cfg.num_layers)


def _feats(out, st: Static):
    return jnp.concatenate([out.hidden[i] for i in _layer_ids(st)], axis=-1)


def _context_write(st: Static, drafter_params, ctx, feats_BxTxF, start_B):
    """Write the drafter-layer K/V of target features at slots start .. start+T-1."""
    module = Drafter(st.drafter, st.target_cfg)
    t = feats_BxTxF.shape[1]
    slots = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)
    new = module.apply({"params": drafter_params}, feats_BxTxF, slots, method=module.context_kv)
    return [
        {name: update_cache(c[name], n[name], start_B) for name in ("k", "v")}
        for c, n in zip(ctx, new, strict=True)
    ]


def prefill(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> State:
    """The prompts through the target (their features fill the drafter's context cache) and
    the first new token sampled from the target at each row's last prompt position."""
    cfg, dcfg = st.target_cfg, st.drafter
    b, p_width = prompts_BxP.shape
    s = cfg.max_seq_len
    history = jnp.zeros((b, s), jnp.int32).at[:, :p_width].set(prompts_BxP)
    zeros_B = jnp.zeros((b,), jnp.int32)
    out = extend_output(
        c.target_params,
        cfg,
        init_cache(cfg, b),
        history,
        zeros_B,
        p_width,
        c.compression,
        _layer_ids(st),
    )
    g, hd = dcfg.num_heads, cfg.d_model // dcfg.num_heads
    ctx = [
        {n: jnp.zeros((b, s, g, hd), jnp.dtype(cfg.compute_dtype)) for n in ("k", "v")}
        for _ in range(dcfg.num_layers)
    ]
    ctx = _context_write(st, c.drafter_params, ctx, _feats(out, st), zeros_B)
    rng, key = jax.random.split(rng)
    last = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    probs = knob_probs(c.knobs)
    first = sample_probs(key, probs(last.astype(jnp.float32)))
    history = _write(history, lengths_B, first[:, None], lengths_B[:, None] >= 0)
    n, k = st.max_new_tokens, dcfg.block_size
    logs = (
        jnp.zeros((n, b, k), jnp.float32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), bool),
    )
    return State(jnp.int32(0), rng, out.cache, ctx, history, lengths_B, logs)


def any_active(c: Ctx, state: State) -> jax.Array:
    return jnp.any(state.pos + 1 < c.end_B)


def draft_step(c: Ctx, state: State, st: Static) -> Draft:
    """Step 1 of the round: drafts, their laws q, confidences and the verify width."""
    cfg, dcfg = st.target_cfg, st.drafter
    b, s = state.pos.shape[0], cfg.max_seq_len
    module = Drafter(dcfg, cfg)
    markov = c.drafter_params.get("markov") if dcfg.uses_markov else None
    rng, k_draft, k_verify = jax.random.split(state.rng, 3)
    active = state.pos + 1 < c.end_B
    pending = jnp.take_along_axis(state.history, state.pos[:, None], axis=1)
    # Only the window [pos - W, pos) is visible: attend to a W-slot slice, not all S slots.
    win = min(dcfg.window, s)
    start = jnp.clip(state.pos - win, 0, s - win)
    window = lambda x: jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, win))(x, start)
    d_out = module.apply(
        {"params": c.drafter_params},
        c.frozen,
        [{n: window(x[n]) for n in ("k", "v")} for x in state.context_kv],
        start[:, None] + jnp.arange(win, dtype=jnp.int32),
        jnp.ones((b, win), bool),
        pending,
        state.pos[:, None],
        method=module.draft,
    )
    probs = knob_probs(c.knobs)
    hidden = d_out.hidden[:, 0] if dcfg.markov_context else None
    drafts, q = markov_draft(k_draft, d_out.base_logits[:, 0], pending[:, 0], markov, probs, hidden)
    conf = jax.nn.sigmoid(d_out.confidence_logits[:, 0])
    if st.mode == "scheduled":
        # drafts past a row's last needed token add nothing: pos + 1 + j <= end - 1
        useful = jnp.clip(c.end_B - 2 - state.pos, 0, dcfg.block_size).astype(jnp.int32)
        width = scheduled_width(conf, st.cost, active, useful)
    else:
        width = jnp.int32(st.fixed_len)
    # A padded verify costs the same for every row, so every active row verifies `width`
    # drafts (what the "width" basis prices).
    lens = jnp.where(active, width, 0).astype(jnp.int32)
    return Draft(rng, k_verify, drafts, q, conf, lens, width.astype(jnp.int32))


def verify_step(c: Ctx, state: State, d: Draft, st: Static, width: int) -> State:
    """Step 2 of the round at a static verify width (1 <= width <= K; d.width == width)."""
    cfg, k = st.target_cfg, st.drafter.block_size
    active = state.pos + 1 < c.end_B
    hist_d = _write(state.history, state.pos + 1, d.drafts, active[:, None])
    o = extend_output(
        c.target_params, cfg, state.target_kv, hist_d, state.pos, width + 1, c.compression,
        _layer_ids(st),
    )  # fmt: skip
    pad = k - width  # speculative_sample takes [B, K + 1] logits; columns past L are unread
    logits = jnp.concatenate([o.logits] + [o.logits[:, -1:]] * pad, axis=1).astype(jnp.float32)
    emitted, acc = speculative_sample(d.verify_key, d.drafts, d.q, knob_probs(c.knobs)(logits),
                                      d.verify_len)  # fmt: skip
    history = _write(state.history, state.pos + 1, emitted, active[:, None] & (emitted >= 0))
    # Features of the w + 1 verified slots; slots past pos + A + 1 are stale, overwritten later.
    ctx = _context_write(st, c.drafter_params, state.context_kv, _feats(o, st), state.pos)
    pos = jnp.where(active, state.pos + acc + 1, state.pos)
    c_log, l_log, a_log, act_log = state.logs
    r = state.r
    logs = (
        c_log.at[r].set(d.confidence),
        l_log.at[r].set(d.verify_len),
        a_log.at[r].set(acc),
        act_log.at[r].set(active),
    )
    return State(r + 1, d.rng, o.cache, ctx, history, pos, logs)
