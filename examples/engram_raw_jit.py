"""Engram from raw `jax.jit` on explicit arrays: no Linen module, no Flax at all.

The Engram layer is a few pure functions of a params dict, so plain JAX code can call them
and own its params however it likes. One layer's forward, piece by piece:

    hash_ids = ngram_hash_ids_jax(tokens, layer_id, cfg)     int32 [B, T, H], exact, no x64
    rows     = flat_row_ids(cfg, layer_id, hash_ids)         + each head's offset in the table
    e        = gather_memory(params, cfg, rows, lookup)      float32 [B, T, E]
    v        = engram_gate_value(params, h[:, :, None], e)   sigmoid-gated value [B, T, 1, D]

(`engram_forward` is these steps in one call.) `lookup` is any
`(table [R, C], rows [B, T, H], row_scale | None) -> [B, T, H*C]`; here it is the user's own
one-line gather. The params are created by hand from `engram_param_shapes`; they have the
names and shapes of the Linen `Engram` module's params, so the two are interchangeable (the
test checks that `Engram.apply` with these params gives the same output, and that the device
hash equals the NumPy host hash `ngram_hash_ids_np` the input pipeline uses).

Run: python examples/engram_raw_jit.py
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from v41jax import (
    EngramConfig,
    engram_forward,
    engram_gate_value,
    engram_param_shapes,
    flat_row_ids,
    gather_memory,
    ngram_hash_ids_jax,
    ngram_hash_ids_np,
)

VOCAB = 50  # compressed vocabulary V'
WIDTH = 16  # model width D
LAYER_ID = 1
CFG = EngramConfig(
    engram_vocab_size=(53, 59, 61),  # orders 2, 3, 4
    max_ngram_size=4,
    n_embed_per_ngram=12,
    n_head_per_ngram=3,
    layer_ids=(LAYER_ID,),
    compressed_vocab_size=VOCAB,
)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    """Random params of one Engram layer, by name and shape (random biases and norm scales
    too, so that every term of the forward is exercised)."""
    params = {}
    for i, (name, shape) in enumerate(sorted(engram_param_shapes(CFG, LAYER_ID, WIDTH).items())):
        k = jax.random.fold_in(key, i)
        if name.endswith("_norm"):
            params[name] = 1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)
        else:
            fan_in = shape[0] if name.startswith("w_") else 1
            params[name] = jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)
    return params


def my_lookup(table: jax.Array, rows: jax.Array, row_scale: jax.Array | None) -> jax.Array:
    """The user's own gather: the H addressed rows of each position, concatenated."""
    del row_scale  # only fp8 tables have one
    return table[rows].reshape(*rows.shape[:-1], -1).astype(jnp.float32)


@jax.jit
def engram_delta(params: dict, h: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Engram delta v [B, T, D] for hidden states h [B, T, D], hash ids [B, T, H])."""
    hash_ids = ngram_hash_ids_jax(tokens, LAYER_ID, CFG)
    rows = flat_row_ids(CFG, LAYER_ID, hash_ids)
    e = gather_memory(params, CFG, rows, my_lookup)
    v = engram_gate_value(params, h[:, :, None, :], e)  # M = 1 branch
    return v[:, :, 0, :], hash_ids


@jax.jit
def engram_delta_one_call(params: dict, h: jax.Array, hash_ids: jax.Array) -> jax.Array:
    """The same through `engram_forward` (which also validates the shapes)."""
    return engram_forward(params, h, hash_ids, CFG, LAYER_ID, lookup=my_lookup)


def main(batch: int = 3, length: int = 10, seed: int = 0) -> dict:
    """Returns tokens, h, params, the hash ids, and the delta from both paths."""
    k_params, k_h, k_tok = jax.random.split(jax.random.key(seed), 3)
    params = init_params(k_params)
    h = jax.random.normal(k_h, (batch, length, WIDTH), jnp.float32)
    tokens = jax.random.randint(k_tok, (batch, length), 0, VOCAB, jnp.int32)
    delta, hash_ids = engram_delta(params, h, tokens)
    return dict(
        tokens=tokens,
        h=h,
        params=params,
        hash_ids=hash_ids,
        delta=delta,
        delta_one_call=engram_delta_one_call(params, h, hash_ids),
    )


if __name__ == "__main__":
    r = main()
    host_ids = ngram_hash_ids_np(np.asarray(r["tokens"]), LAYER_ID, CFG)
    print(f"hash ids {r['hash_ids'].shape}; equal to the NumPy host hash: "
          f"{np.array_equal(np.asarray(r['hash_ids']), host_ids)}")  # fmt: skip
    err = float(jnp.max(jnp.abs(r["delta"] - r["delta_one_call"])))
    print(f"delta {r['delta'].shape}; pieces vs engram_forward: max |diff| = {err:.2e}")
