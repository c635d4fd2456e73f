"""Remat policies keep what they name: the residuals saved for the backward pass of a
scanned stack under each `model.remat_policy`, read with `jax.ad_checkpoint`'s own listing."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax._src.ad_checkpoint import saved_residuals  # the list print_saved_residuals prints

from v41jax.config import ModelConfig
from v41jax.model import Transformer, init_params
from v41jax.model.remat import ATTN_OUT, FFN_OUT, KEY_PROJ, QUERY_PROJ, VALUE_PROJ  # noqa: F401

CFG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48, max_seq_len=16
)
TOKENS = jax.random.randint(jax.random.key(0), (2, 8), 0, 64, dtype=jnp.int32)
NAMES = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_OUT, FFN_OUT)


def _residuals(policy: str, scan: bool) -> list[tuple[tuple[int, ...], str]]:
    cfg = dataclasses.replace(CFG, remat_policy=policy, scan_layers=scan)
    params = nn.unbox(init_params(cfg, jax.random.key(1)))

    def loss(p):
        return Transformer(cfg).apply({"params": p}, TOKENS).logits.sum()

    return [(aval.shape, why) for aval, why in saved_residuals(loss, params)]


def _saved_names(policy: str) -> set[str]:
    """Unrolled blocks: the listing names each tagged value it keeps."""
    described = " ".join(why for _, why in _residuals(policy, scan=False))
    return {name for name in NAMES if f"named '{name}'" in described}


@pytest.mark.parametrize(
    "policy,want",
    [
        ("save_qkv_proj", {QUERY_PROJ, KEY_PROJ, VALUE_PROJ}),
        ("full", set()),
    ],
)
def test_policy_saves_exactly_its_tagged_values(policy, want):
    assert _saved_names(policy) == want


def test_scanned_save_qkv_proj_keeps_the_stacked_projections():
    """Under the layer scan names are not listed, but the kept q [L, B, T, H, K] and k, v
    [L, B, T, G, K] come out of the scan as stacked residuals; "full" keeps none of them."""
    n, (b, t), h, g, k = CFG.num_layers, TOKENS.shape, CFG.num_heads, CFG.num_kv_heads, 8
    q_shape, kv_shape = (n, b, t, h, k), (n, b, t, g, k)
    kept = [shape for shape, _ in _residuals("save_qkv_proj", scan=True)]
    assert kept.count(q_shape) == 1 and kept.count(kv_shape) == 2
    full = [shape for shape, _ in _residuals("full", scan=True)]
    assert q_shape not in full and kv_shape not in full
