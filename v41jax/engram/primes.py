"""Prime table sizes for Engram's hashed n-gram heads (Engram, arXiv 2601.07372, "Primes").

Worked example and the table layouts: docs/engram.md.

Every (layer, order, head) gets its own prime table size so that no two heads share a
modulus. The assignment is the public demo's, bit for bit: one `seen` set across all layers,
walked in `cfg.layer_ids` order; for each layer and each order n in 2..N the search starts at
`engram_vocab_size[n-2] - 1`, each head takes the next prime above the start that is not yet
seen, and the start moves to that prime. With equal per-order sizes the primes of a whole
model are therefore consecutive primes above the size.

Each layer's heads share ONE flat embedding table of `table_rows(cfg, l) = sum(primes)` rows;
head h's rows start at `head_offsets(cfg, l)[h]` (exclusive prefix sums, order-major then
head, the same order as the hash ids).
"""

from __future__ import annotations

import functools

import numpy as np

from v41jax.engram.config import EngramConfig

# Deterministic Miller-Rabin witnesses: these 12 bases decide primality for all n < 3.3e24,
# which covers every 64-bit integer (Sorenson & Webster 2015).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality of an integer n < 2^64 (deterministic Miller-Rabin)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= 1 << 64:
        raise ValueError(f"is_prime({n}): only exact for n < 2^64")
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False  # a witnesses that n is composite
    return True


def next_prime_above(n: int) -> int:
    """The smallest prime strictly greater than n."""
    candidate = max(int(n) + 1, 2)
    while not is_prime(candidate):
        candidate += 1
    return candidate


@functools.lru_cache(maxsize=64)
def _table_sizes(cfg: EngramConfig) -> tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]:
    # Immutable so the cached value cannot be edited through a returned reference.
    for n, size in zip(cfg.orders, cfg.engram_vocab_size, strict=True):
        if size < 2:
            raise ValueError(f"engram_vocab_size for order {n} is {size}; must be >= 2")
    seen: set[int] = set()
    layers = []
    for layer_id in cfg.layer_ids:
        orders = []
        for size in cfg.engram_vocab_size:
            start, heads = size - 1, []
            for _ in range(cfg.n_head_per_ngram):
                prime = next_prime_above(start)
                while prime in seen:  # taken by an earlier layer/order: keep walking up
                    prime = next_prime_above(prime)
                seen.add(prime)
                heads.append(prime)
                start = prime
            orders.append(tuple(heads))
        layers.append((layer_id, tuple(orders)))
    return tuple(layers)


def table_sizes(cfg: EngramConfig) -> dict[int, list[list[int]]]:
    """Prime table size of every head: `{layer_id: [[p_{n,0}, ..., p_{n,K-1}] for n in 2..N]}`.

    Primes are distinct across all layers, orders and heads; `p_{n,j} > engram_vocab_size[n-2]
    - 1`. Keys follow `cfg.layer_ids` order (the order the `seen` set is filled in).
    """
    return {layer: [list(heads) for heads in orders] for layer, orders in _table_sizes(cfg)}


def _check_layer(cfg: EngramConfig, layer_id: int) -> None:
    if layer_id not in cfg.layer_ids:
        raise ValueError(
            f"layer_id={layer_id!r} has no Engram: not in EngramConfig.layer_ids={cfg.layer_ids}"
        )


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # cached and shared: callers must not edit it in place
    return a


@functools.lru_cache(maxsize=256)
def layer_primes(cfg: EngramConfig, layer_id: int) -> np.ndarray:
    """int64 [H] primes of one layer, H = (N-1) * K, order-major then head (the id order)."""
    _check_layer(cfg, layer_id)
    orders = dict(_table_sizes(cfg))[layer_id]
    return _readonly(np.array([p for heads in orders for p in heads], dtype=np.int64))


@functools.lru_cache(maxsize=256)
def head_offsets(cfg: EngramConfig, layer_id: int) -> np.ndarray:
    """int64 [H] first row of each head in the layer's flat table: offsets[h] = sum(p[:h])."""
    primes = layer_primes(cfg, layer_id)
    return _readonly(np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64))


def table_rows(cfg: EngramConfig, layer_id: int) -> int:
    """Rows of the layer's flat embedding table: the sum of its H primes."""
    return int(layer_primes(cfg, layer_id).sum())


def stored_table_rows(cfg: EngramConfig, layer_id: int) -> int:
    """Rows the layer's table stores: `table_rows` rounded up to `cfg.table_row_align` (the
    padding lets the table row-shard evenly; those rows are never addressed)."""
    align = cfg.table_row_align
    return -(-table_rows(cfg, layer_id) // align) * align
