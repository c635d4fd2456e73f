"""Batched speculative decoding: a drafter proposes K tokens, the target verifies them.

Per row b the state keeps `history[b]` (prompt and emitted tokens by position) and `pos[b]`,
the position of the pending token: the last emitted one, not yet fed to either model, so
both KV caches hold positions < pos. One round (all rows at once, per-row acceptance):

  1. drafter: feed (history[pos-1], pending) at pos-1 (re-writing slot pos-1 with the same
     entry, and filling it when the last round accepted all K drafts), then d_1..d_{K-1}
     one at a time; q_j = sampling_probs(drafter logits), d_j ~ q_j          (K calls)
  2. target: feed (pending, d_0, .., d_{K-1}) at pos; p_j = sampling_probs(target logits)
     for j = 0..K (p_K is the bonus distribution)                         (1 call, K+1 tokens)
  3. `speculative_sample` -> A accepted drafts and one more token; write them to history,
     pos += A + 1.
Rollback is free: cache slots past a row's position hold stale entries that causality
never lets a query see, and the next round overwrites them. Both models get the same
sampling settings (`sampling_probs`), which is what makes the output exact.

Shapes: B rows, P prompt width, S = min(max_seq_len of both models).
Requirement: max(prompt length) + max_new_tokens + 2K <= S (a row that finished keeps
running with its position frozen until every row is done).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.engram import ngram_hash_ids_step
from v41jax.model.generate import _check_compression, _window_ending_at, prefill
from v41jax.model.sampling import Scalar, knob_probs, sample_probs, sampling_knobs
from v41jax.model.transformer import Transformer, engram_ids_key
from v41jax.speculative import speculative_sample


class SpeculativeOutput(NamedTuple):
    """tokens int32 [B, max_new_tokens]; rounds int32 [B] (rounds while the row was
    unfinished); accepted_counts int32 [B, K+1]: rounds that accepted exactly a drafts."""

    tokens: jax.Array
    rounds: jax.Array
    accepted_counts: jax.Array


def _engram_extras_at(cfg: ModelConfig, compressed_BxS, start_B, t: int) -> dict:
    """Hash ids of the t tokens at positions start .. start+t-1, from the history."""
    if not cfg.engram.enabled:
        return {}
    windows = [_window_ending_at(cfg, compressed_BxS, start_B + i) for i in range(t)]
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


def extend(params, cfg: ModelConfig, kv, history_BxS, start_B, t: int, compression=None):
    """`extend_output`'s (logits float32 [B, t, V], updated caches)."""
    out = extend_output(params, cfg, kv, history_BxS, start_B, t, compression)
    return out.logits.astype(jnp.float32), out.cache


def _write(history_BxS, start_B, values_BxT, mask_BxT):
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


def check_speculative_generate_args(target_cfg, draft_cfg, prompt_shape, lengths, n_new, k):
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ValueError(
            f"target vocab_size={target_cfg.vocab_size} != drafter vocab_size="
            f"{draft_cfg.vocab_size}: both must sample over the same vocabulary"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft={k!r} must be an int >= 1")
    check_prompt_batch(prompt_shape, lengths, n_new)
    s = min(target_cfg.max_seq_len, draft_cfg.max_seq_len)
    need = int(lengths.max()) + n_new + 2 * k
    if max(need, prompt_shape[1]) > s:
        raise ValueError(
            f"prompt length {int(lengths.max())} + max_new_tokens {n_new} + 2 * num_draft {k} "
            f"= {need} exceeds the smaller max_seq_len {s} (P = {prompt_shape[1]})"
        )


def speculative_generate(
    target_params: Any,
    target_cfg: ModelConfig,
    draft_params: Any,
    draft_cfg: ModelConfig,
    prompt_tokens_BxP: Any,
    prompt_lengths_B: Any,
    *,
    max_new_tokens: int,
    num_draft: int,
    temperature: Scalar = 0.0,
    top_k: Scalar = 0,
    top_p: Scalar = 1.0,
    min_p: Scalar = 0.0,
    rng: jax.Array | None = None,
    compression: Any = None,
) -> SpeculativeOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens, speculatively.

    The output is distributed exactly as `generate(target_params, target_cfg, ...)` with
    the same sampling settings (token-for-token equal at temperature 0). `compression` is
    required when either model has Engram layers.
    """
    check_speculative_generate_args(
        target_cfg,
        draft_cfg,
        tuple(np.shape(prompt_tokens_BxP)),
        prompt_lengths_B,
        max_new_tokens,
        num_draft,
    )
    knobs = sampling_knobs(temperature, top_k, top_p, min_p)
    _check_compression(target_cfg, compression)
    _check_compression(draft_cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    return _speculative_generate(
        target_params,
        draft_params,
        jnp.asarray(prompt_tokens_BxP, jnp.int32),
        jnp.asarray(prompt_lengths_B, jnp.int32),
        jax.random.key(0) if rng is None else rng,
        knobs,
        compression,
        target_cfg=target_cfg,
        draft_cfg=draft_cfg,
        max_new_tokens=max_new_tokens,
        k=num_draft,
    )


@functools.partial(jax.jit, static_argnames=("target_cfg", "draft_cfg", "max_new_tokens", "k"))
def _speculative_generate(
    target_params,
    draft_params,
    prompts_BxP,
    lengths_B,
    rng,
    knobs,
    compression,
    *,
    target_cfg,
    draft_cfg,
    max_new_tokens,
    k,
):
    b, p_width = prompts_BxP.shape
    s = min(target_cfg.max_seq_len, draft_cfg.max_seq_len)
    probs = knob_probs(knobs)

    logits_BxV, target_state = prefill(
        target_params, target_cfg, prompts_BxP, lengths_B, compression
    )
    _, draft_state = prefill(draft_params, draft_cfg, prompts_BxP, lengths_B, compression)
    rng, key = jax.random.split(rng)
    history = jnp.zeros((b, s), jnp.int32).at[:, :p_width].set(prompts_BxP)
    history = _write(
        history, lengths_B, sample_probs(key, probs(logits_BxV))[:, None], lengths_B[:, None] >= 0
    )
    end_B = lengths_B + max_new_tokens  # a row is done once pos + 1 >= end

    def one_round(carry):
        rng, t_kv, d_kv, history, pos, rounds, counts = carry
        rng, *keys = jax.random.split(rng, k + 2)
        active = pos + 1 < end_B
        # 1. draft K tokens; the first call also (re)writes slot pos - 1.
        logits, d_kv = extend(draft_params, draft_cfg, d_kv, history, pos - 1, 2, compression)
        q_list, hist_d = [], history
        for j in range(k):
            if j > 0:
                logits, d_kv = extend(
                    draft_params, draft_cfg, d_kv, hist_d, pos + j, 1, compression
                )
            q_j = probs(logits[:, -1])
            q_list.append(q_j)
            draft_B = sample_probs(keys[j], q_j)
            hist_d = _write(hist_d, pos + j + 1, draft_B[:, None], active[:, None])
        drafts_BxK = jnp.take_along_axis(hist_d, pos[:, None] + 1 + jnp.arange(k), axis=1)
        # 2. verify: one target pass over pending + K drafts.
        logits, t_kv = extend(target_params, target_cfg, t_kv, hist_d, pos, k + 1, compression)
        # 3. accept, emit, advance.
        verify_len = jnp.where(active, k, 0).astype(jnp.int32)
        out, accepted = speculative_sample(
            keys[k], drafts_BxK, jnp.stack(q_list, axis=1), probs(logits), verify_len
        )
        history = _write(history, pos + 1, out, active[:, None] & (out >= 0))
        pos = jnp.where(active, pos + accepted + 1, pos)
        rounds = rounds + active.astype(jnp.int32)
        counts = counts + (active[:, None] & (accepted[:, None] == jnp.arange(k + 1)))
        return rng, t_kv, d_kv, history, pos, rounds, counts

    carry = (
        rng,
        target_state.kv,
        draft_state.kv,
        history,
        lengths_B,
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b, k + 1), jnp.int32),
    )
    carry = jax.lax.while_loop(lambda c: jnp.any(c[4] + 1 < end_B), one_round, carry)
    _, _, _, history, _, rounds, counts = carry
    idx = lengths_B[:, None] + jnp.arange(max_new_tokens)
    return SpeculativeOutput(jnp.take_along_axis(history, idx, axis=1), rounds, counts)
