"""Engram parameter accounting equals the module's real params; budget sizing hits its target."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from v41jax.engram.config import EngramConfig
from v41jax.engram.layer import Engram
from v41jax.engram.params import (
    dense_param_count,
    engram_param_shapes,
    param_count,
    size_tables_for_budget,
    table_padding_count,
    table_param_count,
)
from v41jax.engram.primes import is_prime, layer_primes, table_sizes

CFG = EngramConfig(
    engram_vocab_size=(101, 103),
    max_ngram_size=3,
    n_embed_per_ngram=16,
    n_head_per_ngram=2,
    layer_ids=(0, 2),
    compressed_vocab_size=50,
)


def module_shapes(cfg, layer_id, d, m):
    """{name: shape} of the params `Engram` really creates (abstract init: no memory)."""
    h = jax.ShapeDtypeStruct((1, 3, m, d), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, 3, cfg.num_heads_total), jnp.int32)
    mod = Engram(cfg, layer_id, d, num_branches=m)
    variables = jax.eval_shape(mod.init, jax.random.key(0), h, ids)
    return {k: v.value.shape for k, v in variables["params"].items()}


@pytest.mark.parametrize(
    "cfg,d,m",
    [
        (CFG, 7, 1),
        (CFG, 16, 4),
        (dataclasses.replace(CFG, use_short_conv=True), 16, 1),
        (dataclasses.replace(CFG, use_short_conv=True, kernel_size=3), 12, 4),
        (
            EngramConfig(
                engram_vocab_size=(211, 307, 401),
                max_ngram_size=4,
                n_embed_per_ngram=24,
                n_head_per_ngram=3,
                layer_ids=(5, 1, 3),
                table_dtype="bfloat16",
            ),
            10,
            2,
        ),
    ],
)
def test_param_count_equals_module_params(cfg, d, m):
    real = 0
    for layer in cfg.layer_ids:
        shapes = module_shapes(cfg, layer, d, m)
        assert shapes == engram_param_shapes(cfg, layer, d, m)
        real += sum(math.prod(s) for s in shapes.values())
    assert param_count(cfg, d, m) + table_padding_count(cfg) == real
    assert 0 <= table_padding_count(cfg) < len(cfg.layer_ids) * cfg.table_row_align * cfg.head_dim
    tables = sum(int(layer_primes(cfg, layer).sum()) for layer in cfg.layer_ids) * cfg.head_dim
    assert table_param_count(cfg) == tables
    assert dense_param_count(cfg, d, m) == real - tables - table_padding_count(cfg)


def test_no_layers_no_params():
    cfg = dataclasses.replace(CFG, layer_ids=())
    assert param_count(cfg, 64, 4) == 0
    with pytest.raises(ValueError, match="layer_ids is empty"):
        size_tables_for_budget(cfg, 64, 10**6)


def _count_at(cfg, size, d, m):
    return param_count(dataclasses.replace(cfg, engram_vocab_size=(size,) * len(cfg.orders)), d, m)


@pytest.mark.parametrize(
    "cfg,d,m,target",
    [
        (CFG, 32, 1, 200_000),
        (dataclasses.replace(CFG, use_short_conv=True), 48, 4, 1_234_567),
        # the public demo's layout (2 layers, orders {2,3}, 8 heads, 512/order), a 1B budget
        (
            EngramConfig(n_embed_per_ngram=512, n_head_per_ngram=8, layer_ids=(1, 15)),
            1024,
            4,
            10**9,
        ),
    ],
)
def test_size_tables_for_budget_is_closest(cfg, d, m, target):
    out = size_tables_for_budget(cfg, d, target, m)
    sizes = out.engram_vocab_size
    assert len(set(sizes)) == 1 and len(sizes) == len(cfg.orders)
    assert dataclasses.replace(out, engram_vocab_size=cfg.engram_vocab_size) == cfg
    size, got = sizes[0], param_count(out, d, m)
    # closest over the neighbouring sizes, and off by less than one prime step per head
    for other in (size - 2, size - 1, size + 1, size + 2):
        assert abs(got - target) <= abs(_count_at(cfg, other, d, m) - target), other
    heads = len(cfg.layer_ids) * cfg.num_heads_total
    step = _count_at(cfg, size + 1, d, m) - _count_at(cfg, size, d, m)
    assert abs(got - target) <= step
    assert step <= heads * cfg.head_dim * 2 * math.log(size) ** 2  # prime gaps are small
    assert abs(got - target) / target < 1e-3
    # the returned config is self-consistent: every head's table is a prime >= size
    for orders in table_sizes(out).values():
        assert all(is_prime(p) and p >= size for heads_ in orders for p in heads_)


def test_size_tables_for_budget_errors_and_floor():
    dense = dense_param_count(CFG, 32, 2)
    with pytest.raises(ValueError, match=f"{dense:,}.*> target 1,000"):
        size_tables_for_budget(CFG, 32, 1_000, 2)
    # a budget below the smallest tables gets the smallest tables (size 2), not an error
    out = size_tables_for_budget(CFG, 32, dense + 1, 2)
    assert out.engram_vocab_size == (2, 2)
