"""The chunked head (`model.logits_chunk`): the training loss and its gradients equal the
full-logits loss (tied and untied heads, a chunk that does not divide T, z-loss, masks), and
the compiled train step at V = 128k, T = 2048 needs >= 4x less temporary memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.config import ModelConfig
from v41jax.model import Transformer, init_params
from v41jax.train.step import loss_from_stats, next_token_loss

CFG = ModelConfig(
    vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64
)


def _loss(cfg, params, toks, targets, mask):
    out = Transformer(cfg).apply({"params": params}, toks, targets_BxT=targets)
    if out.logits is None:
        return loss_from_stats(out.lse, out.target_logit, mask, 1e-3)[0]
    return next_token_loss(out.logits, targets, mask, 1e-3)[0]


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_and_grads_equal_the_full_logits(tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 96, (3, 50)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 96, (3, 50)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 50)) > 0.2, jnp.float32)
    grad = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)
    want, g_want = grad(cfg, params, toks, targets, mask)
    got, g_got = grad(dataclasses.replace(cfg, logits_chunk=16), params, toks, targets, mask)
    assert (
        Transformer(dataclasses.replace(cfg, logits_chunk=16))
        .apply({"params": params}, toks, targets_BxT=targets)
        .logits
        is None
    )  # the chunked path ran
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_chunked_head_cuts_the_train_steps_temporary_memory_4x():
    big = ModelConfig(
        vocab_size=131_072, d_model=64, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=128,
        max_seq_len=2048,
    )  # fmt: skip

    def temp_bytes(cfg):
        params = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
        ids = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
        mask = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
        step = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
        compiled = step.trace(cfg, params, ids, ids, mask).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full = temp_bytes(big)
    chunked = temp_bytes(dataclasses.replace(big, logits_chunk=256))
    assert full >= 2 * 2048 * 131_072 * 4 * 0.9  # logits and their gradient, f32
    assert full / chunked >= 4, (full, chunked)
