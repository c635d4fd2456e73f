"""Autoregressive generation with a KV cache: prefill, single-token decode, and `generate`.

All shapes are static: the cache holds `cfg.max_seq_len` slots per layer, prompts are
right-padded to P with per-row lengths, and the decode loop is a `lax.scan` of
`max_new_tokens - 1` steps inside one jit. Row b's prompt fills slots 0..L_b-1 (the padding
after it is written too but never attended, and is overwritten by decoding); its i-th new
token sits at slot L_b + i. `params` is the tree under "params" (boxed or plain).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.model.attention import KVCache
from v41jax.model.sampling import Scalar, check_sampling_args, sample_logits
from v41jax.model.transformer import Transformer


def init_cache(cfg: ModelConfig, batch_size: int, dtype: Any = None) -> list[KVCache]:
    """Zeroed per-layer caches `{"k", "v"}: [B, max_seq_len, num_kv_heads, head_dim]`
    in `dtype` (default: the compute dtype)."""
    dtype = jnp.dtype(cfg.compute_dtype) if dtype is None else dtype
    shape = (batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    return [
        {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.num_layers)
    ]


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill(
    params: Any, cfg: ModelConfig, tokens_BxP: jax.Array, lengths_B: jax.Array
) -> tuple[jax.Array, list[KVCache]]:
    """Run right-padded prompts [B, P] through a fresh cache.

    Returns (logits float32 [B, V] at position lengths[b] - 1, the filled cache).
    Requires P <= cfg.max_seq_len and 1 <= lengths[b] <= P (checked by `generate`).
    """
    b = tokens_BxP.shape[0]
    cache = init_cache(cfg, b)
    out = Transformer(cfg).apply(
        {"params": params}, tokens_BxP, cache=cache, cache_index=jnp.zeros((b,), jnp.int32)
    )
    last_B = jnp.asarray(lengths_B, jnp.int32) - 1
    last_logits_BxV = jnp.take_along_axis(out.logits, last_B[:, None, None], axis=1)[:, 0]
    return last_logits_BxV, out.cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def decode_step(
    params: Any,
    cfg: ModelConfig,
    tokens_B: jax.Array,
    cache: list[KVCache],
    positions_B: jax.Array,
) -> tuple[jax.Array, list[KVCache]]:
    """Feed one token per row at absolute positions [B] (= its cache slot).

    Returns (next-token logits float32 [B, V], the cache with that slot written).
    """
    positions_B = jnp.asarray(positions_B, jnp.int32)
    out = Transformer(cfg).apply(
        {"params": params},
        tokens_B[:, None],
        positions_B[:, None],
        cache=cache,
        cache_index=positions_B,
    )
    return out.logits[:, 0], out.cache


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
    temperature: Scalar = 0.0,
    top_k: Scalar = 0,
    top_p: Scalar = 1.0,
    rng: jax.Array | None = None,
    eos_id: int | None = None,
) -> jax.Array:
    """Continue each right-padded prompt by `max_new_tokens` tokens: int32 [B, max_new_tokens].

    Sampling as in `sample_logits` (temperature 0 = greedy; rng default key 0). After a row
    emits `eos_id` it keeps emitting `eos_id`. Raises ValueError when lengths are outside
    [1, P] or max(lengths) + max_new_tokens > cfg.max_seq_len.
    """
    _check_generate_args(cfg, tuple(prompt_tokens_BxP.shape), prompt_lengths_B, max_new_tokens)
    check_sampling_args(temperature, top_k, top_p)
    rng = jax.random.key(0) if rng is None else rng
    return _generate(
        params,
        cfg,
        jnp.asarray(prompt_tokens_BxP, jnp.int32),
        jnp.asarray(prompt_lengths_B, jnp.int32),
        rng,
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id"))
def _generate(
    params, cfg, tokens_BxP, lengths_B, rng, temperature, top_k, top_p, *, max_new_tokens, eos_id
):
    def sample(key, logits_BxV, done_B):
        tok_B = sample_logits(key, logits_BxV, temperature, top_k, top_p)
        if eos_id is None:
            return tok_B, done_B
        tok_B = jnp.where(done_B, eos_id, tok_B)
        return tok_B, done_B | (tok_B == eos_id)

    logits_BxV, cache = prefill(params, cfg, tokens_BxP, lengths_B)
    rng, key = jax.random.split(rng)
    first_B, done_B = sample(key, logits_BxV, jnp.zeros(lengths_B.shape, bool))

    def step(carry, key):
        cache, tok_B, pos_B, done_B = carry
        logits_BxV, cache = decode_step(params, cfg, tok_B, cache, pos_B)
        tok_B, done_B = sample(key, logits_BxV, done_B)
        return (cache, tok_B, pos_B + 1, done_B), tok_B

    keys = jax.random.split(rng, max_new_tokens - 1)
    _, rest_NxB = jax.lax.scan(step, (cache, first_B, lengths_B, done_B), keys)
    return jnp.concatenate([first_B[:, None], rest_NxB.T], axis=1)
