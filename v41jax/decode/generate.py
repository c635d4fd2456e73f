"""Autoregressive generation with a KV cache: prefill, single-token decode, and `generate`.

All shapes are static: the cache holds `cfg.max_seq_len` slots per layer (stacked per
scanned run of layers, see `init_cache`), prompts are right-padded to P with per-row
lengths, and the decode loop is a `lax.scan` of `max_new_tokens - 1` steps inside one jit.
Row b's prompt fills slots 0..L_b-1 (the padding after it is written too but never attended,
and is overwritten by decoding); its i-th new token sits at slot L_b + i. `params` is the
tree under "params" (boxed or plain).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.decode.sampling import GREEDY, SamplingParams, sample_logits, sampling_plan
from v41jax.engram import ngram_hash_ids_jax, ngram_hash_ids_step, roll_window
from v41jax.model.attention import KVCache
from v41jax.model.layout import layer_segments
from v41jax.model.transformer import Transformer, engram_ids_key


class DecodeState(NamedTuple):
    """What decoding carries between steps.

    kv: the KV caches {segment: {"k", "v"}} (`init_cache`).
    engram_window: int32 [B, max_ngram_size] compressed ids of the last tokens fed (last
        column = most recent; pad_id before the start) when the model has Engram, else None:
        the next token's hash ids need only these (`ngram_hash_ids_step`).
    """

    kv: dict[str, KVCache]
    engram_window: jax.Array | None = None


def _engram_extras_full(cfg: ModelConfig, compressed_BxT: jax.Array) -> dict[str, jax.Array]:
    return {
        engram_ids_key(layer): ngram_hash_ids_jax(compressed_BxT, layer, cfg.engram)
        for layer in cfg.engram.layer_ids
    }


def window_ending_at(
    cfg: ModelConfig, compressed_BxP: jax.Array, last_B: jax.Array, rows_B: jax.Array | None = None
):
    """[B, N] compressed ids at positions last-N+1 .. last (pad_id where < 0), of row b, or
    of row rows_B[b] when given (packed tokens: last and rows are per token)."""
    n = cfg.engram.max_ngram_size
    pos_BxN = last_B[:, None] - (n - 1) + jnp.arange(n, dtype=jnp.int32)
    if rows_B is None:
        got_BxN = jnp.take_along_axis(compressed_BxP, jnp.maximum(pos_BxN, 0), axis=1)
    else:
        got_BxN = compressed_BxP[rows_B[:, None], jnp.maximum(pos_BxN, 0)]
    return jnp.where(pos_BxN >= 0, got_BxN, cfg.engram.pad_id).astype(jnp.int32)


def check_compression(cfg: ModelConfig, compression: jax.Array | None) -> None:
    if cfg.engram.enabled and compression is None:
        raise ValueError(
            "this model has Engram layers: pass `compression`, the tokenizer's compression "
            "table (int32 [vocab_size], original id -> compressed id)"
        )


def with_context_len(cfg: ModelConfig, context_len: int) -> ModelConfig:
    """`cfg` with `max_seq_len = context_len`: its KV caches and decode history hold that many
    slots per row. Decoding reads and writes the whole cache every step, so a server whose
    requests need S slots (prompt + new tokens + the drafter's slack) allocates S, not the
    model's max_seq_len, and its step cost follows S. The parameters do not depend on it
    (RoPE angles are computed from positions), so the same params decode with either config.
    Shorter than the model's: positions past `max_seq_len` were never trained."""
    n = context_len
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.max_seq_len:
        raise ValueError(f"context_len={n!r} must be an int in [1, max_seq_len={cfg.max_seq_len}]")
    return dataclasses.replace(cfg, max_seq_len=n)


def init_cache(cfg: ModelConfig, batch_size: int, dtype: Any = None) -> dict[str, KVCache]:
    """Zeroed KV caches in `dtype` (default: the compute dtype), one entry per segment of the
    model (`v41jax.model.layout.layer_segments`): `{"k", "v"}` of shape
    [L_run, B, max_seq_len, num_kv_heads, head_dim] for a scanned run of L_run layers,
    [B, max_seq_len, num_kv_heads, head_dim] for a single block."""
    dtype = jnp.dtype(cfg.compute_dtype) if dtype is None else dtype
    shape = (batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    out = {}
    for seg in layer_segments(cfg):
        full = (seg.stop - seg.start, *shape) if seg.scanned else shape
        out[seg.name] = {"k": jnp.zeros(full, dtype), "v": jnp.zeros(full, dtype)}
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill(
    params: Any,
    cfg: ModelConfig,
    tokens_BxP: jax.Array,
    lengths_B: jax.Array,
    compression: jax.Array | None = None,
) -> tuple[jax.Array, DecodeState]:
    """Run right-padded prompts [B, P] through a fresh cache.

    Returns (logits float32 [B, V] at position lengths[b] - 1, the decode state).
    Requires P <= cfg.max_seq_len and 1 <= lengths[b] <= P (checked by `generate`).
    compression: int32 [V] original -> compressed ids, required when the model has Engram.
    """
    check_compression(cfg, compression)
    b = tokens_BxP.shape[0]
    last_B = jnp.asarray(lengths_B, jnp.int32) - 1
    extras, window = {}, None
    if cfg.engram.enabled:
        compressed_BxP = jnp.asarray(compression)[tokens_BxP]
        extras = _engram_extras_full(cfg, compressed_BxP)
        window = window_ending_at(cfg, compressed_BxP, last_B)
    out = Transformer(cfg).apply(
        {"params": params},
        tokens_BxP,
        cache=init_cache(cfg, b),
        cache_index=jnp.zeros((b,), jnp.int32),
        extras=extras,
    )
    last_logits_BxV = jnp.take_along_axis(out.logits, last_B[:, None, None], axis=1)[:, 0]
    return last_logits_BxV, DecodeState(out.cache, window)


@functools.partial(jax.jit, static_argnames=("cfg",))
def decode_step(
    params: Any,
    cfg: ModelConfig,
    tokens_B: jax.Array,
    state: DecodeState,
    positions_B: jax.Array,
    compression: jax.Array | None = None,
) -> tuple[jax.Array, DecodeState]:
    """Feed one token per row at absolute positions [B] (= its cache slot).

    Returns (next-token logits float32 [B, V], the state with that slot written). With
    Engram, the token's hash ids come from the rolled window of the last max_ngram_size
    compressed tokens: O(1) per token, equal to hashing the whole sequence again.
    """
    check_compression(cfg, compression)
    positions_B = jnp.asarray(positions_B, jnp.int32)
    extras, window = {}, state.engram_window
    if cfg.engram.enabled:
        window = roll_window(window, jnp.asarray(compression)[tokens_B])
        extras = {
            engram_ids_key(layer): ngram_hash_ids_step(window, layer, cfg.engram)[:, None, :]
            for layer in cfg.engram.layer_ids
        }
    out = Transformer(cfg).apply(
        {"params": params},
        tokens_B[:, None],
        positions_B[:, None],
        cache=state.kv,
        cache_index=positions_B,
        extras=extras,
    )
    return out.logits[:, 0], DecodeState(out.cache, window)


def _check_generate_args(
    cfg: ModelConfig, prompt_shape: tuple[int, ...], lengths: Any, max_new_tokens: int
) -> None:
    if len(prompt_shape) != 2:
        raise ValueError(f"prompt_tokens must be [B, P], got shape {prompt_shape}")
    b, p = prompt_shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if p > cfg.max_seq_len:
        raise ValueError(f"prompt width P={p} exceeds model.max_seq_len={cfg.max_seq_len}")
    if np.shape(lengths) != (b,):
        raise ValueError(f"prompt_lengths must have shape ({b},), got {np.shape(lengths)}")
    longest = p
    if not isinstance(lengths, jax.core.Tracer):
        lengths = np.asarray(lengths)
        if lengths.min() < 1 or lengths.max() > p:
            raise ValueError(f"prompt_lengths {lengths.tolist()} must lie in [1, P={p}]")
        longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
            f"{longest + max_new_tokens} exceeds model.max_seq_len={cfg.max_seq_len}"
        )


def generate(
    params: Any,
    cfg: ModelConfig,
    prompt_tokens_BxP: jax.Array,
    prompt_lengths_B: jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    eos_id: int | None = None,
    compression: Any = None,
) -> jax.Array:
    """Continue each right-padded prompt by `max_new_tokens` tokens: int32 [B, max_new_tokens].

    Each token is drawn as `sample_logits(key, logits, sampling)` (default greedy; rng default
    key 0). After a row emits `eos_id` it keeps emitting `eos_id`. `compression` (int32 [V],
    the tokenizer's compression table) is required when the model has Engram layers. Raises
    ValueError when lengths are outside [1, P] or max(lengths) + max_new_tokens >
    cfg.max_seq_len.
    """
    _check_generate_args(cfg, tuple(prompt_tokens_BxP.shape), prompt_lengths_B, max_new_tokens)
    check_compression(cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    rng = jax.random.key(0) if rng is None else rng
    # Decided here, from the settings' values while they are still concrete: which sampling
    # stages can matter (greedy: argmax alone; no top-k / top-p: no sort), so the decode loop
    # traces only those. One compilation per plan; traced settings get the general one.
    plan = sampling_plan(sampling)
    return _generate(
        params,
        cfg,
        jnp.asarray(prompt_tokens_BxP, jnp.int32),
        jnp.asarray(prompt_lengths_B, jnp.int32),
        rng,
        sampling.as_arrays(),
        compression,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        plan=plan,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id", "plan"))
def _generate(
    params,
    cfg,
    tokens_BxP,
    lengths_B,
    rng,
    sampling,
    compression,
    *,
    max_new_tokens,
    eos_id,
    plan,
):
    def sample(key, logits_BxV, done_B):
        tok_B = sample_logits(key, logits_BxV, sampling, plan=plan)
        if eos_id is None:
            return tok_B, done_B
        tok_B = jnp.where(done_B, eos_id, tok_B)
        return tok_B, done_B | (tok_B == eos_id)

    logits_BxV, state = prefill(params, cfg, tokens_BxP, lengths_B, compression)
    rng, key = jax.random.split(rng)
    first_B, done_B = sample(key, logits_BxV, jnp.zeros(lengths_B.shape, bool))

    def step(carry, key):
        state, tok_B, pos_B, done_B = carry
        logits_BxV, state = decode_step(params, cfg, tok_B, state, pos_B, compression)
        tok_B, done_B = sample(key, logits_BxV, done_B)
        return (state, tok_B, pos_B + 1, done_B), tok_B

    keys = jax.random.split(rng, max_new_tokens - 1)
    _, rest_NxB = jax.lax.scan(step, (state, first_B, lengths_B, done_B), keys)
    return jnp.concatenate([first_B[:, None], rest_NxB.T], axis=1)
