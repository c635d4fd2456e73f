"""Prime table sizes: exact Miller-Rabin, the reference's prime walk, offsets and errors."""

import dataclasses
import math

import numpy as np
import pytest

from v41jax.engram.config import EngramConfig
from v41jax.engram.primes import (
    head_offsets,
    is_prime,
    layer_primes,
    next_prime_above,
    table_rows,
    table_sizes,
)

# The demo's docstring lists layer 1 of its default config (sizes 129280*5, 8 heads, layers
# [1, 15]); layer 15 was computed once with the trial-division walk below.
DEMO = EngramConfig(engram_vocab_size=(646_400, 646_400), n_head_per_ngram=8, layer_ids=(1, 15))
DEMO_PRIMES = {
    1: [
        [646403, 646411, 646421, 646423, 646433, 646453, 646519, 646523],
        [646537, 646543, 646549, 646571, 646573, 646577, 646609, 646619],
    ],
    15: [
        [646631, 646637, 646643, 646669, 646687, 646721, 646757, 646771],
        [646781, 646823, 646831, 646837, 646843, 646859, 646873, 646879],
    ],
}

CONFIGS = [
    DEMO,
    EngramConfig(
        engram_vocab_size=(1001, 30_011, 77_777), max_ngram_size=4, n_head_per_ngram=4,
        n_embed_per_ngram=64, layer_ids=(0, 2, 5),
    ),
    EngramConfig(engram_vocab_size=(50,), max_ngram_size=2, n_head_per_ngram=3,
                 n_embed_per_ngram=6, layer_ids=(4,)),
    EngramConfig(
        engram_vocab_size=(97, 1000, 97, 123_457), max_ngram_size=5, n_head_per_ngram=2,
        n_embed_per_ngram=8, layer_ids=(9, 3),
    ),
    EngramConfig(engram_vocab_size=(2, 2), n_head_per_ngram=2, n_embed_per_ngram=4,
                 layer_ids=(0, 1)),
]  # fmt: skip


def slow_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def slow_table_sizes(cfg: EngramConfig) -> dict[int, list[list[int]]]:
    """The reference walk, written as 'scan upward from start + 1 for an unseen prime'."""
    seen, out = set(), {}
    for layer in cfg.layer_ids:
        out[layer] = []
        for size in cfg.engram_vocab_size:
            heads, c = [], size
            while len(heads) < cfg.n_head_per_ngram:
                if slow_is_prime(c) and c not in seen:
                    heads.append(c)
                    seen.add(c)
                c += 1
            out[layer].append(heads)
    return out


def test_is_prime_matches_trial_division_below_20000():
    got = [n for n in range(-5, 20_000) if is_prime(n)]
    assert got == [n for n in range(20_000) if slow_is_prime(n)]


@pytest.mark.parametrize(
    "n, expected",
    [
        (2**61 - 1, True),
        (18_446_744_073_709_551_557, True),  # the largest prime below 2^64
        (561, False),  # Carmichael
        (3_215_031_751, False),  # strong pseudoprime to bases 2, 3, 5, 7
        (3_825_123_056_546_413_051, False),  # strong pseudoprime to bases 2..23
        (2_147_483_647, True),
        (646_403 * 646_411, False),
    ],
)
def test_is_prime_large(n, expected):
    assert is_prime(n) is expected


def test_next_prime_above():
    assert [next_prime_above(n) for n in (-3, 0, 1, 2, 3, 7, 646_399, 646_403)] == [
        2, 2, 2, 3, 5, 11, 646_403, 646_411,
    ]  # fmt: skip


def test_demo_primes_literal():
    assert table_sizes(DEMO) == DEMO_PRIMES


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_table_sizes_match_independent_walk(cfg):
    sizes = table_sizes(cfg)
    assert sizes == slow_table_sizes(cfg)
    assert list(sizes) == list(cfg.layer_ids)
    flat = [p for layer in sizes.values() for heads in layer for p in heads]
    assert len(set(flat)) == len(flat) == len(cfg.layer_ids) * cfg.num_heads_total
    for layer in sizes.values():
        for size, heads in zip(cfg.engram_vocab_size, layer, strict=True):
            assert all(p >= size for p in heads) and heads == sorted(heads)


def test_primes_consecutive_when_sizes_equal():
    flat = sorted(p for layer in table_sizes(DEMO).values() for heads in layer for p in heads)
    expected = [n for n in range(646_400, flat[-1] + 1) if slow_is_prime(n)]
    assert flat == expected


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_layer_primes_offsets_rows(cfg):
    for layer, orders in table_sizes(cfg).items():
        primes = layer_primes(cfg, layer)
        assert primes.dtype == np.int64 and primes.shape == (cfg.num_heads_total,)
        assert primes.tolist() == [p for heads in orders for p in heads]  # order-major
        offsets = head_offsets(cfg, layer)
        assert offsets.tolist() == [sum(primes.tolist()[:h]) for h in range(primes.size)]
        assert table_rows(cfg, layer) == sum(primes.tolist())
        with pytest.raises(ValueError):  # cached arrays are read-only
            primes[0] = 1


def test_layer_not_in_layer_ids():
    with pytest.raises(ValueError, match=r"layer_id=7"):
        layer_primes(DEMO, 7)
    with pytest.raises(ValueError, match=r"layer_id=7"):
        head_offsets(DEMO, 7)


def test_size_below_two_is_rejected():
    with pytest.raises(ValueError, match=r"order 3 is 1"):
        dataclasses.replace(DEMO, engram_vocab_size=(100, 1))
