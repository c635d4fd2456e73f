"""Hashed n-gram ids for Engram, bit-identical to the reference (arXiv 2601.07372).

The spec with a worked example, and why the device path is exact without x64: docs/engram.md.

For Engram layer l with odd multipliers m_0..m_{N-1} (`layer_multipliers`) and compressed ids
x, the shifted streams are x_k[t] = x[t-k] (pad_id where t-k < 0), and for n in 2..N and
head j:

    mix_n[t] = (x_0[t] * m_0) XOR ... XOR (x_{n-1}[t] * m_{n-1})      (exact 64-bit)
    id[t, (n-2) * K + j] = mix_n[t] mod p_{n,j}                       (primes.table_sizes)

Every product is below 2^63 because m_k < int64_max // V' and x < V', so the reference's
int64 arithmetic never overflows and mix_n is a non-negative 63-bit integer.

Two paths compute the same ids:
- `ngram_hash_ids_np`: host/input pipeline; NumPy in, NumPy out; int64 arithmetic as in the
  reference; validates dtype and range of the ids.
- `ngram_hash_ids_jax`: device; jit-able with static `cfg` and `layer_id`; int32 in, int32
  out, and never enables x64. The 64-bit values are carried as (hi, lo) uint32 pairs:
  x * m = x * m_lo + 2^32 * (x * m_hi), with the 32x32->64 product x * m_lo built from 16-bit
  limbs (every partial sum stays below 2^32) and x * m_hi needing only its low 32 bits since
  the true high word is < 2^31. XOR acts on each word. `mix mod p` is Horner's rule in base
  2^w: r = hi mod p, then r = (r * 2^w + next w bits of lo) mod p, where w = 32 - bitlen(p-1)
  keeps r * 2^w + chunk < 2^32. Every step is an exact uint32 operation, so the result equals
  the int64 reference for any input in range (tests compare against Python integers).
  Contract: ids must lie in [0, V'); out-of-range ids are not detected (they still produce
  ids in [0, p), so a table gather never goes out of bounds) unless `checked=True`, which
  runs the range check under `jax.experimental.checkify` and returns `(err, ids)`; call
  `err.throw()` outside jit.

Boundaries:
- Causal by construction: position t reads x[t-N+1..t] only, so changing token t changes ids
  at positions t..t+N-1 only.
- Packed documents: with `segment_ids` and `cfg.reset_at_segments`, x_k[t] = pad_id whenever
  t-k lies before the start of t's document (a change of segment id from t-1 to t starts one),
  which equals hashing each document on its own.
- Generation: `ngram_hash_ids_step` hashes a window of the last N tokens on device and equals
  the last position of the full computation; `prefix_window`/`roll_window` maintain it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from v41jax.engram.config import EngramConfig, require_vocab
from v41jax.engram.primes import layer_primes

_INT64_MAX = np.iinfo(np.int64).max
_SEED_STRIDE = 10007  # the reference's PRIME_1: layer l seeds its generator with seed + 10007*l


@functools.lru_cache(maxsize=256)
def layer_multipliers(cfg: EngramConfig, layer_id: int) -> np.ndarray:
    """int64 [N] odd multipliers of one layer, N = max_ngram_size.

    m = 2 * default_rng(seed + 10007 * l).integers(0, half_bound, N) + 1 with
    half_bound = max(1, (int64_max // V') // 2), so x * m < 2^63 for every id x < V'.
    """
    vocab = require_vocab(cfg)
    layer_primes(cfg, layer_id)  # the clear error for a layer without Engram
    half_bound = max(1, (_INT64_MAX // vocab) // 2)
    rng = np.random.default_rng(cfg.seed + _SEED_STRIDE * layer_id)
    m = rng.integers(0, half_bound, size=cfg.max_ngram_size, dtype=np.int64) * 2 + 1
    m.flags.writeable = False  # cached and shared
    return m


def _doc_offsets_np(segment_ids: np.ndarray) -> np.ndarray:
    """[B, T] distance from each position back to the start of its document."""
    t = np.arange(segment_ids.shape[1])
    starts = np.ones(segment_ids.shape, dtype=bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return t - np.maximum.accumulate(np.where(starts, t, 0), axis=1)


def _check_host_ids(x: np.ndarray, vocab: int, name: str) -> None:
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name} has dtype {x.dtype}; compressed ids must be integers")
    if x.ndim != 2:
        raise ValueError(f"{name} has shape {x.shape}; expected [batch, time]")
    bad = (x < 0) | (x >= vocab)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} holds {x[pos]} at {pos}: compressed ids must lie in [0, V'={vocab}) "
            "(negative ids pass through compression; mask them to pad_id first)"
        )


def _check_segments(segment_ids, shape: tuple[int, ...]) -> None:
    if segment_ids.shape != shape:
        raise ValueError(f"segment_ids has shape {segment_ids.shape}; expected {shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids has dtype {segment_ids.dtype}; expected integers")


def ngram_hash_ids_np(
    compressed_ids: np.ndarray,
    layer_id: int,
    cfg: EngramConfig,
    segment_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Host path: [B, T] compressed ids -> [B, T, (N-1)*K] hash ids, order-major then head.

    int64 arithmetic as in the reference. Returns int32 (int64 only if a prime were >= 2^31).
    `segment_ids` [B, T] resets the n-gram context at document starts when
    `cfg.reset_at_segments` (ignored otherwise). Raises TypeError for non-integer ids and
    ValueError naming the value for ids outside [0, V').
    """
    vocab = require_vocab(cfg)
    x = np.asarray(compressed_ids)
    _check_host_ids(x, vocab, "compressed_ids")
    m, primes = layer_multipliers(cfg, layer_id), layer_primes(cfg, layer_id)
    n_max, k_heads = cfg.max_ngram_size, cfg.n_head_per_ngram
    x = x.astype(np.int64, copy=False)
    b, t = x.shape
    padded = np.concatenate([np.full((b, n_max - 1), cfg.pad_id, np.int64), x], axis=1)
    offsets = None
    if segment_ids is not None and cfg.reset_at_segments:
        segment_ids = np.asarray(segment_ids)
        _check_segments(segment_ids, x.shape)
        offsets = _doc_offsets_np(segment_ids)
    out_dtype = np.int32 if primes.max() < 2**31 else np.int64
    out = np.empty((b, t, primes.size), dtype=out_dtype)
    mix = None
    for k in range(n_max):
        x_k = padded[:, n_max - 1 - k : n_max - 1 - k + t]
        if offsets is not None:
            x_k = np.where(k <= offsets, x_k, cfg.pad_id)
        mix = x_k * m[k] if k == 0 else mix ^ (x_k * m[k])  # mix_{k+1}: shared by its heads
        if k >= 1:
            heads = slice((k - 1) * k_heads, k * k_heads)
            out[:, :, heads] = mix[:, :, None] % primes[heads]
    return out


# ---------------------------------------------------------------- device path (uint32 pairs)


def _mul_wide_u32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact 64-bit product of uint32 a and b as (hi, lo) uint32 words, via 16-bit limbs.

    a*b = a1*b1*2^32 + (a1*b0 + a0*b1)*2^16 + a0*b0; each partial sum below is < 2^32.
    """
    mask = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & mask, a >> 16, b & mask, b >> 16
    low = a0 * b0
    mid1 = a1 * b0 + (low >> 16)
    mid2 = a0 * b1 + (mid1 & mask)
    hi = a1 * b1 + (mid1 >> 16) + (mid2 >> 16)
    return hi, (mid2 << 16) | (low & mask)


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array, width: int) -> jax.Array:
    """(hi * 2^32 + lo) mod p in uint32, by Horner's rule over `width`-bit chunks of lo.

    Needs r * 2^width + chunk < 2^32 for every r < p, i.e. width <= 32 - bitlen(max p - 1).
    """
    r = hi % p
    left = 32
    while left:
        w = min(width, left)
        left -= w
        chunk = (lo >> jnp.uint32(left)) & jnp.uint32((1 << w) - 1)
        r = ((r << jnp.uint32(w)) | chunk) % p
    return r


def _hash_streams_u32(streams: list[jax.Array], layer_id: int, cfg: EngramConfig) -> jax.Array:
    """N uint32 shifted streams (any common shape S) -> int32 [*S, (N-1)*K] hash ids."""
    m, primes = layer_multipliers(cfg, layer_id), layer_primes(cfg, layer_id)
    if primes.max() >= 2**31:
        raise ValueError(f"prime table size {primes.max()} >= 2^31 does not fit int32 ids")
    width = 32 - int(primes.max() - 1).bit_length()
    k_heads = cfg.n_head_per_ngram
    m_lo, m_hi = (m & 0xFFFFFFFF).astype(np.uint32), (m >> 32).astype(np.uint32)
    out, mix_hi, mix_lo = [], None, None
    for k, x_k in enumerate(streams):
        hi, lo = _mul_wide_u32(x_k, jnp.uint32(m_lo[k]))
        hi = hi + x_k * jnp.uint32(m_hi[k])  # no wrap: the true high word is < 2^31
        mix_hi, mix_lo = (hi, lo) if k == 0 else (mix_hi ^ hi, mix_lo ^ lo)
        if k >= 1:
            p = jnp.asarray(primes[(k - 1) * k_heads : k * k_heads].astype(np.uint32))
            out.append(_mod_u64(mix_hi[..., None], mix_lo[..., None], p, width))
    return lax.bitcast_convert_type(jnp.concatenate(out, axis=-1), jnp.int32)


def _as_u32(ids: jax.Array, name: str) -> jax.Array:
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {ids.dtype}; compressed ids must be integers")
    # Same bits for ids in [0, 2^31); documented garbage-in-range for anything else.
    return lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.uint32)


def _streams_jax(x: jax.Array, cfg: EngramConfig, segment_ids: jax.Array | None) -> list:
    """[B, T] uint32 -> N shifted streams x_k [B, T], pad_id before 0 / the document start."""
    n_max, (b, t) = cfg.max_ngram_size, x.shape
    pad = jnp.uint32(cfg.pad_id)
    padded = jnp.concatenate([jnp.full((b, n_max - 1), pad, jnp.uint32), x], axis=1)
    streams = [padded[:, n_max - 1 - k : n_max - 1 - k + t] for k in range(n_max)]
    if segment_ids is not None and cfg.reset_at_segments:
        _check_segments(segment_ids, x.shape)
        pos = jnp.arange(t, dtype=jnp.int32)
        starts = jnp.concatenate(
            [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
        )
        offsets = pos - lax.cummax(jnp.where(starts, pos, 0), axis=1)
        streams = [jnp.where(k <= offsets, s, pad) for k, s in enumerate(streams)]
    return streams


def _check_range(ids: jax.Array, vocab: int) -> None:
    ok = jnp.all((ids >= 0) & (ids < vocab))
    msg = f"compressed ids must lie in [0, V'={vocab}); got min {{lo}}, max {{hi}}"
    checkify.check(ok, msg, lo=jnp.min(ids), hi=jnp.max(ids))


def ngram_hash_ids_jax(
    compressed_ids: jax.Array,
    layer_id: int,
    cfg: EngramConfig,
    segment_ids: jax.Array | None = None,
    checked: bool = False,
):
    """Device path: int32 [B, T] compressed ids -> int32 [B, T, (N-1)*K], exact, no x64.

    jit with `cfg` and `layer_id` static. Contract: ids in [0, V') (not checked unless
    `checked`). `checked=True` returns `(err, ids)` from `checkify.checkify`; `err.throw()`
    raises (outside jit) if any id was out of range; the ids are computed either way.
    """
    require_vocab(cfg)
    if compressed_ids.ndim != 2:
        raise ValueError(f"compressed_ids has shape {compressed_ids.shape}; expected [B, T]")
    if not jnp.issubdtype(compressed_ids.dtype, jnp.integer):
        raise TypeError(f"compressed_ids has dtype {compressed_ids.dtype}; expected integers")

    def run(ids, seg):
        if checked:
            _check_range(ids, cfg.compressed_vocab_size)
        x = _as_u32(ids, "compressed_ids")
        return _hash_streams_u32(_streams_jax(x, cfg, seg), layer_id, cfg)

    if checked:
        return checkify.checkify(run)(compressed_ids, segment_ids)
    return run(compressed_ids, segment_ids)


def ngram_hash_ids(
    compressed_ids,
    layer_id: int,
    cfg: EngramConfig,
    segment_ids=None,
):
    """[B, T] compressed ids -> [B, T, (N-1)*K] ids: NumPy in -> host path, jax in -> device."""
    if isinstance(compressed_ids, jax.Array):
        return ngram_hash_ids_jax(compressed_ids, layer_id, cfg, segment_ids)
    return ngram_hash_ids_np(compressed_ids, layer_id, cfg, segment_ids)


# ---------------------------------------------------------------- incremental (generation)


def ngram_hash_ids_step(window_BxN: jax.Array, layer_id: int, cfg: EngramConfig) -> jax.Array:
    """int32 [B, N] window -> int32 [B, (N-1)*K] ids of its last token (device, jit-able).

    window[:, N-1] is the current compressed token and window[:, N-1-k] the token k back
    (pad_id before the start of the sequence/document). Equals the last position of
    `ngram_hash_ids_jax` over the whole sequence.
    """
    n_max = cfg.max_ngram_size
    if window_BxN.ndim != 2 or window_BxN.shape[1] != n_max:
        raise ValueError(f"window has shape {window_BxN.shape}; expected [B, {n_max}]")
    w = _as_u32(window_BxN, "window")
    return _hash_streams_u32([w[:, n_max - 1 - k] for k in range(n_max)], layer_id, cfg)


def prefix_window(
    compressed_ids: jax.Array, cfg: EngramConfig, segment_ids: jax.Array | None = None
) -> jax.Array:
    """int32 [B, T] prompt -> [B, N] window ending at its last token, pad_id-filled as needed.

    With `segment_ids` and `cfg.reset_at_segments`, tokens before the last document start are
    replaced by pad_id, as the full computation does. T = 0 gives an all-pad window.
    """
    b, t = compressed_ids.shape
    n_max = cfg.max_ngram_size
    if t == 0:
        return jnp.full((b, n_max), cfg.pad_id, jnp.int32)
    x = _as_u32(compressed_ids, "compressed_ids")
    streams = _streams_jax(x, cfg, segment_ids)
    window = jnp.stack([streams[n_max - 1 - i][:, -1] for i in range(n_max)], axis=1)
    return lax.bitcast_convert_type(window, jnp.int32)


def roll_window(window_BxN: jax.Array, token_B: jax.Array) -> jax.Array:
    """Append the next compressed token: [B, N], [B] -> [B, N] (oldest token dropped)."""
    token = token_B.astype(window_BxN.dtype)[:, None]
    return jnp.concatenate([window_BxN[:, 1:], token], axis=1)
