"""Batched DSpark speculative decoding with per-request verify lengths (REFERENCE.md §3-4).

State per row b: `history[b]` (prompt and emitted tokens by slot), `pos[b]` the slot of the
pending token (emitted, not yet fed to the target). The target's KV cache holds slots < pos;
the drafter's context cache holds, per drafter layer, the K/V of the target features of
slots < pos (`Drafter.context_kv`, written once per accepted position). One round:

  1. draft: one drafter pass over the block [pending, mask x (K-1)] at slots pos .. pos+K-1,
     attending to context slots [pos - window, pos); the Markov head then samples
     d_1 .. d_K sequentially (`markov_draft`), returning q_k, the exact law of d_k;
  2. lengths: L_b = K ("fixed"), or from the confidences alone ("scheduled",
     `schedule_verify_lengths` on the measured cost table). Confidences come from the
     drafter's pass before any draft is sampled, so L never depends on the target or on the
     sampled drafts, and the output law is unchanged (see `v41jax.spec.pipeline_audit`);
  3. verify: the target extends [pending, d_1 .. d_w] at slot pos, w = max_b L_b, one of K
     static widths (`lax.switch`: only the chosen width runs); rows with L_b < w are masked
     by their verify length, not by shape;
  4. `speculative_sample(key, d, q, p, L)`: A_b accepted drafts and one more token; the
     target features of slots pos .. pos+A go into the drafter's context cache; pos += A+1.
Rollback is free: slots >= pos hold stale entries that no query can see, and the next round
overwrites them. Greedy (temperature 0) output equals plain greedy decoding token for token.
Requirement: max(prompt length) + max_new_tokens + 2K + 1 <= target max_seq_len.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.dspark.config import DrafterConfig
from v41jax.dspark.drafter import Drafter, FrozenTarget
from v41jax.dspark.markov import markov_draft
from v41jax.dspark.scheduler import CostTable, measure_cost_table, schedule_verify_lengths
from v41jax.model.attention import update_cache
from v41jax.model.generate import _check_compression, init_cache
from v41jax.model.sampling import Scalar, knob_probs, sampling_knobs
from v41jax.model.speculative import _write, check_prompt_batch, extend_output
from v41jax.spec import speculative_sample

MODES = ("fixed", "scheduled")


class DSparkOutput(NamedTuple):
    """tokens int32 [B, N]; rounds int32 [B]; and a per-round log, R = N rounds at most:
    confidence float32 [R, B, K] (sigmoid of the confidence head), verify_len int32 [R, B],
    accepted int32 [R, B], active bool [R, B] (row still generating in that round)."""

    tokens: jax.Array
    rounds: jax.Array
    confidence: jax.Array
    verify_len: jax.Array
    accepted: jax.Array
    active: jax.Array


def check_dspark_args(
    target_cfg: ModelConfig,
    drafter: DrafterConfig,
    prompt_shape,
    lengths,
    n_new: int,
    mode: str,
    verify_len: int | None,
) -> None:
    k = drafter.block_size
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} not in {MODES}")
    if verify_len is not None and not 1 <= verify_len <= k:
        raise ValueError(f"verify_len={verify_len} must be in [1, block_size={k}]")
    check_prompt_batch(prompt_shape, lengths, n_new)
    lengths = np.asarray(lengths)
    need = int(lengths.max()) + n_new + 2 * k + 1
    if max(need, prompt_shape[1]) > target_cfg.max_seq_len:
        raise ValueError(
            f"prompt length {int(lengths.max())} + max_new_tokens {n_new} + 2 * block_size {k}"
            f" + 1 = {need} exceeds the target's max_seq_len {target_cfg.max_seq_len}"
        )


def dspark_generate(
    target_params: Any,
    target_cfg: ModelConfig,
    drafter_params: Any,
    drafter: DrafterConfig,
    frozen: FrozenTarget,
    prompt_tokens_BxP: Any,
    prompt_lengths_B: Any,
    *,
    max_new_tokens: int,
    mode: str = "fixed",
    verify_len: int | None = None,
    cost: CostTable | None = None,
    temperature: Scalar = 0.0,
    top_k: Scalar = 0,
    top_p: Scalar = 1.0,
    min_p: Scalar = 0.0,
    rng: jax.Array | None = None,
    compression: Any = None,
) -> DSparkOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens with DSpark drafts.

    mode "fixed" verifies `verify_len` (default K) drafts per row per round; "scheduled"
    chooses per-row lengths from the confidences and `cost` (required). The output is
    distributed exactly as `generate(target_params, ...)` with the same sampling settings.
    """
    check_dspark_args(
        target_cfg,
        drafter,
        tuple(np.shape(prompt_tokens_BxP)),
        prompt_lengths_B,
        max_new_tokens,
        mode,
        verify_len,
    )
    if mode == "scheduled" and cost is None:
        raise ValueError("mode='scheduled' needs the target's verify cost table (cost=...)")
    knobs = sampling_knobs(temperature, top_k, top_p, min_p)
    _check_compression(target_cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    drafter_params, target_params = nn.unbox(drafter_params), nn.unbox(target_params)
    return _dspark_generate(
        target_params,
        drafter_params,
        frozen,
        jnp.asarray(prompt_tokens_BxP, jnp.int32),
        jnp.asarray(prompt_lengths_B, jnp.int32),
        jax.random.key(0) if rng is None else rng,
        knobs,
        compression,
        target_cfg=target_cfg,
        drafter=drafter,
        max_new_tokens=max_new_tokens,
        mode=mode,
        fixed_len=verify_len or drafter.block_size,
        cost=cost,
    )


def _context_write(module, drafter_params, ctx, feats_BxTxF, start_B):
    """Write the drafter-layer K/V of target features at slots start .. start+T-1."""
    t = feats_BxTxF.shape[1]
    slots = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)
    new = module.apply({"params": drafter_params}, feats_BxTxF, slots, method=module.context_kv)
    return [
        {name: update_cache(c[name], n[name], start_B) for name in ("k", "v")}
        for c, n in zip(ctx, new, strict=True)
    ]


@functools.partial(
    jax.jit,
    static_argnames=("target_cfg", "drafter", "max_new_tokens", "mode", "fixed_len", "cost"),
)
def _dspark_generate(
    target_params,
    drafter_params,
    frozen,
    prompts_BxP,
    lengths_B,
    rng,
    knobs,
    compression,
    *,
    target_cfg,
    drafter,
    max_new_tokens,
    mode,
    fixed_len,
    cost,
):
    b, p_width = prompts_BxP.shape
    k, s = drafter.block_size, target_cfg.max_seq_len
    layer_ids = drafter.layer_ids_for(target_cfg.num_layers)
    module = Drafter(drafter, target_cfg)
    markov = drafter_params.get("markov") if drafter.uses_markov else None
    probs = knob_probs(knobs)
    feats = lambda out: jnp.concatenate([out.hidden[i] for i in layer_ids], axis=-1)

    # Prefill: the prompt through the target (its features fill the drafter's context cache).
    history = jnp.zeros((b, s), jnp.int32).at[:, :p_width].set(prompts_BxP)
    zeros_B = jnp.zeros((b,), jnp.int32)
    out = extend_output(
        target_params,
        target_cfg,
        init_cache(target_cfg, b),
        history,
        zeros_B,
        p_width,
        compression,
        layer_ids,
    )
    f = len(layer_ids) * target_cfg.d_model
    g, hd = drafter.num_heads, target_cfg.d_model // drafter.num_heads
    ctx = [
        {n: jnp.zeros((b, s, g, hd), jnp.dtype(target_cfg.compute_dtype)) for n in ("k", "v")}
        for _ in range(drafter.num_layers)
    ]
    ctx = _context_write(module, drafter_params, ctx, feats(out), zeros_B)
    rng, key = jax.random.split(rng)
    last = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    first = jax.random.categorical(key, jnp.log(probs(last.astype(jnp.float32))), axis=-1)
    history = _write(history, lengths_B, first.astype(jnp.int32)[:, None], lengths_B[:, None] >= 0)
    end_B = lengths_B + max_new_tokens  # a row is done once pos + 1 >= end
    win = min(drafter.window, s)

    def verify_branch(width):
        def run(t_kv, hist, pos):
            o = extend_output(
                target_params, target_cfg, t_kv, hist, pos, width + 1, compression, layer_ids
            )
            pad = k + 1 - (width + 1)
            logits = jnp.concatenate([o.logits] + [o.logits[:, -1:]] * pad, axis=1)
            fe = feats(o)
            fe = jnp.concatenate([fe, jnp.zeros((b, pad, f), fe.dtype)], axis=1)
            return logits.astype(jnp.float32), fe, o.cache

        return run

    def one_round(carry):
        r, rng, t_kv, ctx, history, pos, logs = carry
        rng, k_draft, k_verify = jax.random.split(rng, 3)
        active = pos + 1 < end_B
        pending = jnp.take_along_axis(history, pos[:, None], axis=1)
        # Only the window [pos - W, pos) is visible: attend to a W-slot slice, not all S slots.
        start = jnp.clip(pos - win, 0, s - win)
        window = lambda x: jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, win))(x, start)
        d_out = module.apply(
            {"params": drafter_params},
            frozen,
            [{n: window(c[n]) for n in ("k", "v")} for c in ctx],
            start[:, None] + jnp.arange(win, dtype=jnp.int32),
            jnp.ones((b, win), bool),
            pending,
            pos[:, None],
            method=module.draft,
        )
        drafts, q = markov_draft(k_draft, d_out.base_logits[:, 0], pending[:, 0], markov, probs)
        conf = jax.nn.sigmoid(d_out.confidence_logits[:, 0])
        if mode == "scheduled":
            lens = schedule_verify_lengths(conf, cost, basis="padded").verify_len
        else:
            lens = jnp.full((b,), fixed_len, jnp.int32)
        lens = jnp.where(active, lens, 0).astype(jnp.int32)
        hist_d = _write(history, pos + 1, drafts, active[:, None])
        width = jnp.clip(jnp.max(lens), 1, k)
        if mode == "scheduled":
            branches = [verify_branch(w) for w in range(1, k + 1)]
            logits, fe, t_kv = jax.lax.switch(width - 1, branches, t_kv, hist_d, pos)
        else:
            logits, fe, t_kv = verify_branch(fixed_len)(t_kv, hist_d, pos)
        emitted, acc = speculative_sample(k_verify, drafts, q, probs(logits), lens)
        history = _write(history, pos + 1, emitted, active[:, None] & (emitted >= 0))
        ctx = _context_write(module, drafter_params, ctx, fe, pos)
        pos = jnp.where(active, pos + acc + 1, pos)
        c_log, l_log, a_log, act_log = logs
        logs = (
            c_log.at[r].set(conf),
            l_log.at[r].set(lens),
            a_log.at[r].set(acc),
            act_log.at[r].set(active),
        )
        return r + 1, rng, t_kv, ctx, history, pos, logs

    n = max_new_tokens
    logs = (
        jnp.zeros((n, b, k), jnp.float32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), jnp.int32),
        jnp.zeros((n, b), bool),
    )
    carry = (jnp.int32(0), rng, out.cache, ctx, history, lengths_B, logs)
    carry = jax.lax.while_loop(lambda c: jnp.any(c[5] + 1 < end_B), one_round, carry)
    _, _, _, _, history, _, (c_log, l_log, a_log, act_log) = carry
    idx = lengths_B[:, None] + jnp.arange(max_new_tokens)
    rounds = act_log.sum(0).astype(jnp.int32)
    return DSparkOutput(
        jnp.take_along_axis(history, idx, axis=1), rounds, c_log, l_log, a_log, act_log
    )


def measure_verify_cost(
    target_params,
    target_cfg: ModelConfig,
    batch_size: int,
    block_size: int,
    repeats: int = 5,
    steps: int = 8,
) -> CostTable:
    """The target's verify-step cost: seconds of one cached forward of w tokens per row for
    w = 2 .. K + 1 (the pending token and 1 .. K drafts), B rows; tokens = B * w.

    Timed as `steps` forwards in a `lax.scan` that carries the KV cache, as decoding does (the
    cache is updated in place); a standalone call would also copy the whole cache in and out,
    a fixed cost that flattens the curve the scheduler trades against.
    """
    b, s = batch_size, target_cfg.max_seq_len
    kv = init_cache(target_cfg, b)
    history = jnp.zeros((b, s), jnp.int32)
    start = s // 4  # mid-sequence, as in decoding
    steps = max(1, min(steps, (s - start) // (block_size + 1)))  # every write stays inside S

    def step_for_width(w):
        @jax.jit
        def run(kv):
            def body(kv, i):
                pos = jnp.full((b,), start, jnp.int32) + i * w
                out = extend_output(target_params, target_cfg, kv, history, pos, w)
                return out.cache, out.logits[:, -1, 0]

            return jax.lax.scan(body, kv, jnp.arange(steps))[1]

        return lambda: run(kv)

    table = measure_cost_table(step_for_width, range(2, block_size + 2), b, repeats=repeats)
    return CostTable(table.tokens, tuple(t / steps for t in table.seconds))


def load_or_measure_cost(
    drafter_workdir: str,
    target_params,
    target_cfg: ModelConfig,
    drafter: DrafterConfig,
    batch_size: int,
) -> CostTable:
    """The cost table saved with the drafter run for this batch size, measured on first use
    (`cost_table_b{B}.json`; delete it to re-measure on another machine)."""
    path = os.path.join(drafter_workdir, f"cost_table_b{batch_size}.json")
    if os.path.exists(path):
        return CostTable.load(path)
    cost = measure_verify_cost(target_params, target_cfg, batch_size, drafter.block_size)
    cost.save(path)
    return cost
