"""`attach_new_modules`: mHC (every form, both residual kinds, several n) and Engram attached
to a plain model start at its function, learn from the first step, and bad trees are refused
by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig
from v41jax.engram import EngramConfig, ngram_hash_ids_np
from v41jax.mhc import MHCConfig
from v41jax.model import Transformer, convert_layout, engram_ids_key, layer_segments
from v41jax.model.attach import attach_new_modules

BASE = ModelConfig(
    vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32
)
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, 64)


def _init(cfg, seed=0, extras=None):
    variables = Transformer(cfg).init(jax.random.PRNGKey(seed), TOKENS, extras=extras)
    return nn.unbox(variables)["params"]


def _pretrained():
    """A plain model whose norm scales are not ones, so a pass that dropped one would show,
    and whose embeddings have unit RMS, as a trained model's residual stream has: the start
    is exact up to the norms' eps relative to the stream's mean square (see `attach`), and
    at the init's std 0.02 that is 1e-6 / 4e-4."""
    flat = traverse_util.flatten_dict(_init(BASE, seed=3))
    keys = jax.random.split(jax.random.PRNGKey(7), len(flat))
    for k, (path, value) in zip(keys, list(flat.items()), strict=True):
        if path[-1] == "scale":
            flat[path] = value + 0.3 * jax.random.normal(k, value.shape)
        elif path[-1] == "embedding":
            flat[path] = value / jnp.sqrt(jnp.mean(value**2))
    return traverse_util.unflatten_dict(flat)


def _logits(cfg, params, extras=None):
    return Transformer(cfg).apply({"params": params}, TOKENS, extras=extras).logits


@pytest.mark.parametrize(
    "n, form, residual",
    [
        (4, "reference", "mhc"),
        (4, "fused", "mhc"),
        (4, "single_pass", "mhc"),
        (3, "reference", "mhc"),
        (2, "single_pass", "mhc"),
        (1, "reference", "mhc"),
        (4, "reference", "hc"),
    ],
)
def test_mhc_attached_to_a_plain_model_starts_at_its_function(n, form, residual):
    source = _pretrained()
    want = _logits(BASE, source)
    cfg = dataclasses.replace(BASE, mhc=MHCConfig(n_streams=n, form=form, residual=residual))
    fresh = _init(cfg, seed=11)
    params = attach_new_modules(convert_layout(source, layer_segments(cfg)), fresh)
    # the final norm's eps acts as eps / n^2: ~5e-7 of the logits' scale (see `attach`)
    tol = 2e-6 * float(jnp.abs(want).max())
    np.testing.assert_allclose(_logits(cfg, params), want, rtol=1e-5, atol=tol)
    # negative control: the fresh phi (std 1/sqrt(nC), alpha 0.01) moves the logits
    flat = traverse_util.flatten_dict(params)
    for path, value in traverse_util.flatten_dict(fresh).items():
        if path[-1] == "phi":
            flat[path] = value
    moved = _logits(cfg, traverse_util.unflatten_dict(flat))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(moved, want, rtol=1e-5, atol=tol)

    # phi = 0 is a start, not a fixed point: its gradient is not zero
    def loss(p):
        logp = jax.nn.log_softmax(_logits(cfg, p))
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], TOKENS[:, 1:, None], -1))

    grads = traverse_util.flatten_dict(jax.grad(loss)(params))
    phi_grads = [g for path, g in grads.items() if path[-1] == "phi"]
    assert phi_grads and all(float(jnp.abs(g).max()) > 0 for g in phi_grads)


def test_mhc_and_engram_attached_together():
    engram = EngramConfig(
        engram_vocab_size=(101, 103),
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(1,),
        compressed_vocab_size=64,
        table_row_align=8,
    )
    cfg = dataclasses.replace(BASE, mhc=MHCConfig(n_streams=4, form="fused"), engram=engram)
    extras = {engram_ids_key(1): jnp.asarray(ngram_hash_ids_np(np.asarray(TOKENS), 1, engram))}
    source = _pretrained()
    params = attach_new_modules(
        convert_layout(source, layer_segments(cfg)), _init(cfg, seed=5, extras=extras)
    )
    got = _logits(cfg, params, extras)
    want = _logits(BASE, source)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * float(jnp.abs(want).max()))
    flat = traverse_util.flatten_dict(params)
    zeroed = [p[-1] for p, v in flat.items() if not np.any(np.asarray(v))]
    assert {"b_v", "phi", "w_v"} <= set(zeroed) <= {"b_v", "phi", "w_v", "b_k"}  # b_k: init 0


def test_bad_trees_are_refused_by_name():
    source = _pretrained()
    cfg = dataclasses.replace(BASE, mhc=MHCConfig(n_streams=2))
    fresh = _init(cfg)
    src = convert_layout(source, layer_segments(cfg))
    wider = dict(src, embed={"embedding": jnp.zeros((64, 48))})
    with pytest.raises(ValueError, match="embed/embedding has shape"):
        attach_new_modules(wider, fresh)
    with pytest.raises(ValueError, match="no param for.*lora"):
        attach_new_modules(dict(src, lora={"a": jnp.zeros(3)}), fresh)
    missing = {k: v for k, v in src.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="source has no param final_norm/scale"):
        attach_new_modules(missing, fresh)
