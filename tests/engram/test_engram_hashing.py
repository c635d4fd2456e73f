"""Engram n-gram hash ids: both paths bit-identical to an independent Python-int reference."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from v41jax.engram.config import EngramConfig
from v41jax.engram.hashing import (
    layer_multipliers,
    ngram_hash_ids,
    ngram_hash_ids_jax,
    ngram_hash_ids_np,
    ngram_hash_ids_step,
    prefix_window,
    roll_window,
)

CONFIGS = {
    "demo_n3": EngramConfig(
        engram_vocab_size=(646_400, 646_400), max_ngram_size=3, n_head_per_ngram=8,
        layer_ids=(1, 15), compressed_vocab_size=99_991, pad_id=2,
    ),
    "n4_odd": EngramConfig(
        engram_vocab_size=(1001, 30_011, 77_777), max_ngram_size=4, n_head_per_ngram=4,
        n_embed_per_ngram=64, layer_ids=(0, 2, 5), compressed_vocab_size=5000, pad_id=7, seed=3,
    ),
    "n2": EngramConfig(
        engram_vocab_size=(50,), max_ngram_size=2, n_head_per_ngram=3, n_embed_per_ngram=6,
        layer_ids=(4,), compressed_vocab_size=300, seed=11,
    ),
    "n5": EngramConfig(
        engram_vocab_size=(97, 1000, 10_007, 123_457), max_ngram_size=5, n_head_per_ngram=2,
        n_embed_per_ngram=8, layer_ids=(9, 3), compressed_vocab_size=40_000, pad_id=1, seed=42,
    ),
    "tiny_vocab": EngramConfig(  # V' = 3: multipliers near 2^62, the widest products
        engram_vocab_size=(10, 10), n_head_per_ngram=2, n_embed_per_ngram=4, layer_ids=(0,),
        compressed_vocab_size=3,
    ),
    "primes_near_2^31": EngramConfig(  # mod by 31-bit primes: 1-bit Horner steps on device
        engram_vocab_size=(2**31 - 2000, 2**31 - 1000), n_head_per_ngram=2, n_embed_per_ngram=4,
        layer_ids=(6,), compressed_vocab_size=1_000_003, pad_id=5, seed=7,
    ),
}  # fmt: skip

# ---------------------------------------------------------------- independent reference


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def ref_primes(cfg: EngramConfig, layer_id: int) -> list[int]:
    """The reference prime walk with trial division; flat, order-major then head."""
    seen = set()
    for layer in cfg.layer_ids:
        flat = []
        for size in cfg.engram_vocab_size:
            c = size
            for _ in range(cfg.n_head_per_ngram):
                while not _is_prime(c) or c in seen:
                    c += 1
                seen.add(c)
                flat.append(c)
        if layer == layer_id:
            return flat
    raise AssertionError(layer_id)


def ref_multipliers(cfg: EngramConfig, layer_id: int) -> list[int]:
    bound = max(1, (2**63 - 1) // cfg.compressed_vocab_size // 2)
    g = np.random.default_rng(cfg.seed + 10007 * layer_id)
    return [2 * int(r) + 1 for r in g.integers(0, bound, size=cfg.max_ngram_size, dtype=np.int64)]


_PRIME_CACHE: dict = {}


def ref_hash(x, layer_id: int, cfg: EngramConfig, segment_ids=None) -> np.ndarray:
    """Python-int hashing, one position at a time; documents restart at segment changes."""
    key = (cfg, layer_id)
    if key not in _PRIME_CACHE:
        _PRIME_CACHE[key] = ref_primes(cfg, layer_id)
    primes, m = _PRIME_CACHE[key], ref_multipliers(cfg, layer_id)
    x = [[int(v) for v in row] for row in np.asarray(x)]
    out = np.zeros((len(x), len(x[0]), len(primes)), dtype=np.int64)
    for b, row in enumerate(x):
        start = 0
        for t in range(len(row)):
            if segment_ids is not None and t and segment_ids[b][t] != segment_ids[b][t - 1]:
                start = t
            ids = []
            for n in range(2, cfg.max_ngram_size + 1):
                mix = 0
                for k in range(n):
                    mix ^= (row[t - k] if t - k >= start else cfg.pad_id) * m[k]
                assert 0 <= mix < 2**63  # the reference's int64 never overflows
                k_heads = cfg.n_head_per_ngram
                ids += [mix % p for p in primes[(n - 2) * k_heads : (n - 1) * k_heads]]
            out[b, t] = ids
    return out


def random_ids(cfg, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.compressed_vocab_size, size=shape)
    x.flat[:4] = [0, cfg.compressed_vocab_size - 1, 0, cfg.compressed_vocab_size - 1]
    return x


def random_segments(shape, seed=0):
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.random(shape) < 0.15, axis=1) % 3  # ids repeat: only changes count


hash_jit = jax.jit(ngram_hash_ids_jax, static_argnums=(1, 2))

# ---------------------------------------------------------------- golden equality


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("segments", [False, True])
def test_both_paths_match_reference(name, segments):
    cfg = CONFIGS[name]
    x = random_ids(cfg, (3, 40), seed=len(name))
    seg = random_segments(x.shape, seed=len(name)) if segments else None
    for layer in cfg.layer_ids:
        expected = ref_hash(x, layer, cfg, seg)
        host = ngram_hash_ids_np(x, layer, cfg, seg)
        assert host.dtype == np.int32 and host.shape == (3, 40, cfg.num_heads_total)
        np.testing.assert_array_equal(host, expected)
        jseg = None if seg is None else jnp.asarray(seg, jnp.int32)
        dev = hash_jit(jnp.asarray(x, jnp.int32), layer, cfg, jseg)
        assert dev.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(dev), expected)
    assert not jax.config.jax_enable_x64


def test_multipliers_match_reference_and_literal():
    cfg = CONFIGS["demo_n3"]
    for name, c in CONFIGS.items():
        for layer in c.layer_ids:
            m = layer_multipliers(c, layer)
            assert m.dtype == np.int64 and m.tolist() == ref_multipliers(c, layer), name
            assert all(v % 2 == 1 for v in m.tolist())
    assert layer_multipliers(cfg, 1).tolist() == [75943111494179, 4796361690939, 35636365767609]


# Computed once with `ref_hash` (demo_n3, layer 15): heads 0 and 7 of order 2, 0 and 7 of
# order 3, per position. Catches drift in the reference itself (numpy rng, prime walk).
LITERAL_X = [[0, 5, 99_990, 17, 2, 31_337]]
LITERAL_HEADS = [0, 7, 8, 15]
LITERAL_IDS = [
    [402747, 102015, 8270, 627155],
    [442528, 313276, 612026, 119669],
    [27227, 520494, 173746, 413196],
    [55360, 366393, 14114, 472785],
    [479561, 53548, 22933, 622686],
    [460992, 620452, 110562, 63479],
]


def test_literal_golden_ids():
    cfg = CONFIGS["demo_n3"]
    host = ngram_hash_ids(np.array(LITERAL_X), 15, cfg)
    dev = ngram_hash_ids(jnp.array(LITERAL_X, jnp.int32), 15, cfg)
    assert isinstance(host, np.ndarray) and isinstance(dev, jax.Array)
    for ids in (host, np.asarray(dev)):
        assert ids[0][:, LITERAL_HEADS].tolist() == LITERAL_IDS


# ---------------------------------------------------------------- boundaries


@pytest.mark.parametrize("name", ["demo_n3", "n4_odd", "n5"])
def test_causal(name):
    cfg = CONFIGS[name]
    n_max, layer = cfg.max_ngram_size, cfg.layer_ids[-1]
    x = random_ids(cfg, (2, 24), seed=1)
    base = ngram_hash_ids_np(x, layer, cfg)
    base_dev = np.asarray(hash_jit(jnp.asarray(x, jnp.int32), layer, cfg))
    for t in (0, 5, 21, 23):
        y = x.copy()
        y[:, t] = (y[:, t] + 1) % cfg.compressed_vocab_size
        for ids in (ngram_hash_ids_np(y, layer, cfg),
                    np.asarray(hash_jit(jnp.asarray(y, jnp.int32), layer, cfg))):  # fmt: skip
            changed = np.any(ids != base, axis=(0, 2))
            window = np.zeros(24, bool)
            window[t : t + n_max] = True
            np.testing.assert_array_equal(changed, window)
            # Order n sees token t at positions t..t+n-1 only.
            for n in cfg.orders:
                block = slice((n - 2) * cfg.n_head_per_ngram, (n - 1) * cfg.n_head_per_ngram)
                changed_n = np.any(ids[..., block] != base[..., block], axis=(0, 2))
                assert np.flatnonzero(changed_n).tolist() == list(range(t, min(t + n, 24)))
    np.testing.assert_array_equal(base_dev, base)


@pytest.mark.parametrize("name", ["demo_n3", "n5"])
def test_segment_reset_equals_separate_documents(name):
    cfg = CONFIGS[name]
    layer = cfg.layer_ids[0]
    lengths = [1, 7, 2, 13]
    docs = [random_ids(cfg, (1, n), seed=i) for i, n in enumerate(lengths)]
    x = np.concatenate(docs, axis=1)
    seg = np.repeat([[5, 9, 5, 2]], lengths, axis=1)  # ids may repeat across documents
    separate = np.concatenate([ngram_hash_ids_np(d, layer, cfg) for d in docs], axis=1)
    np.testing.assert_array_equal(ngram_hash_ids_np(x, layer, cfg, seg), separate)
    dev = hash_jit(jnp.asarray(x, jnp.int32), layer, cfg, jnp.asarray(seg, jnp.int32))
    np.testing.assert_array_equal(np.asarray(dev), separate)
    # Without the flag the context spans documents, as in the reference.
    spanning = dataclasses.replace(cfg, reset_at_segments=False)
    np.testing.assert_array_equal(
        ngram_hash_ids_np(x, layer, spanning, seg), ngram_hash_ids_np(x, layer, cfg)
    )
    assert not np.array_equal(separate, ngram_hash_ids_np(x, layer, cfg))


@pytest.mark.parametrize("name", ["demo_n3", "n4_odd", "n2"])
def test_incremental_step_equals_full(name):
    cfg = CONFIGS[name]
    layer = cfg.layer_ids[-1]
    x = jnp.asarray(random_ids(cfg, (3, 20), seed=2), jnp.int32)
    full = np.asarray(hash_jit(x, layer, cfg))
    step = jax.jit(ngram_hash_ids_step, static_argnums=(1, 2))
    roll = jax.jit(roll_window)
    prefix = jax.jit(prefix_window, static_argnums=1)
    window = prefix(x[:, :0], cfg)  # empty prompt: all pad
    for t in range(x.shape[1]):
        window = roll(window, x[:, t])
        got = step(window, layer, cfg)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), full[:, t])
    # A prompt prefilled in one go, then continued; and a window after a document start.
    for t in (1, 9):  # prompts shorter and longer than the window
        window = prefix(x[:, :t], cfg)
        np.testing.assert_array_equal(np.asarray(step(window, layer, cfg)), full[:, t - 1])
    seg = jnp.asarray(np.repeat([[0, 1]], [6, 14], axis=1).repeat(3, 0), jnp.int32)
    full_seg = np.asarray(hash_jit(x, layer, cfg, seg))
    window = prefix(x[:, :7], cfg, seg[:, :7])  # one token into the second document
    for t in range(7, 12):
        np.testing.assert_array_equal(np.asarray(step(window, layer, cfg)), full_seg[:, t - 1])
        window = roll(window, x[:, t])


def test_jit_eager_and_sharded_agree_without_x64():
    cfg = CONFIGS["n2"]
    x = random_ids(cfg, (8, 32), seed=3)
    expected = ngram_hash_ids_np(x, 4, cfg)
    eager = ngram_hash_ids_jax(jnp.asarray(x, jnp.int32), 4, cfg)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded = hash_jit(jax.device_put(jnp.asarray(x, jnp.int32), spec), 4, cfg)
    assert sharded.sharding.is_equivalent_to(spec, 3)
    for ids in (eager, sharded):
        assert ids.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(ids), expected)
    assert not jax.config.jax_enable_x64


# ---------------------------------------------------------------- errors and checked mode


def test_checked_mode_catches_out_of_range():
    cfg = CONFIGS["n2"]
    f = jax.jit(lambda x: ngram_hash_ids_jax(x, 4, cfg, checked=True))
    good = jnp.asarray(random_ids(cfg, (2, 8)), jnp.int32)
    err, ids = f(good)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(ids), ngram_hash_ids_np(np.asarray(good), 4, cfg))
    err, _ = f(good.at[1, 3].set(300))
    with pytest.raises(checkify.JaxRuntimeError, match=r"\[0, V'=300\).*max 300"):
        err.throw()
    err, _ = f(good.at[0, 0].set(-4))
    with pytest.raises(checkify.JaxRuntimeError, match=r"min -4"):
        err.throw()


def test_host_errors_name_the_value():
    cfg = CONFIGS["n2"]
    x = random_ids(cfg, (2, 8))
    with pytest.raises(TypeError, match=r"float64"):
        ngram_hash_ids_np(x.astype(np.float64), 4, cfg)
    with pytest.raises(ValueError, match=r"holds 300 at \(0, 2\).*V'=300"):
        ngram_hash_ids_np(np.where(np.arange(8) == 2, 300, x), 4, cfg)
    with pytest.raises(ValueError, match=r"holds -3 at \(0, 5\)"):
        ngram_hash_ids_np(np.where(np.arange(8) == 5, -3, x), 4, cfg)
    with pytest.raises(ValueError, match=r"layer_id=2 .*layer_ids=\(4,\)"):
        ngram_hash_ids_np(x, 2, cfg)
    with pytest.raises(ValueError, match=r"compressed_vocab_size is 0"):
        ngram_hash_ids_np(x, 4, dataclasses.replace(cfg, compressed_vocab_size=0))
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        ngram_hash_ids_np(x.ravel(), 4, cfg)
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 7\)"):
        ngram_hash_ids_np(x, 4, cfg, segment_ids=np.zeros((2, 7), np.int32))


def test_device_errors_at_trace_time():
    cfg = CONFIGS["n2"]
    with pytest.raises(TypeError, match=r"float32"):
        hash_jit(jnp.zeros((2, 8), jnp.float32), 4, cfg)
    with pytest.raises(ValueError, match=r"layer_id=3"):
        hash_jit(jnp.zeros((2, 8), jnp.int32), 3, cfg)
    with pytest.raises(ValueError, match=r"expected \[B, 2\]"):
        ngram_hash_ids_step(jnp.zeros((2, 3), jnp.int32), 4, cfg)
