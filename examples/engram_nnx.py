"""Engram inside a Flax NNX model, through `flax.nnx.bridge.ToNNX`.

v41jax's `Engram` is a Flax Linen module. `nnx.bridge.ToNNX` turns it into a stateful NNX
module whose variables (the hashed n-gram `table`, `w_k`, `w_v`, the norms...) become NNX
attributes, so it drops into any NNX model. This script builds a tiny NNX language model

    h = embed(tokens);   h = h + Engram(h, hash_ids);   logits = head(h)

where `hash_ids = ngram_hash_ids_jax(tokens, layer_id, cfg)` are the per-head hashed n-gram
ids (the tokens serve as their own compressed ids here, so `compressed_vocab_size` is the
vocabulary size). It then takes one optax/NNX training step and checks that the step changed
exactly the Engram table rows the batch addressed (`flat_row_ids`), which is what a sparse
memory should do: rows no n-gram in the batch hashes to get a zero gradient.

Run: python examples/engram_nnx.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import bridge

from v41jax import Engram, EngramConfig, flat_row_ids, ngram_hash_ids_jax

VOCAB = 32
WIDTH = 16
LAYER_ID = 0
CFG = EngramConfig(
    engram_vocab_size=(37, 41),  # min rows per order (2-grams, 3-grams); primes are above
    max_ngram_size=3,
    n_embed_per_ngram=8,
    n_head_per_ngram=2,
    layer_ids=(LAYER_ID,),
    compressed_vocab_size=VOCAB,
)


def linen_engram() -> Engram:
    """The Linen module being wrapped (also used to check the bridge against)."""
    return Engram(CFG, layer_id=LAYER_ID, hidden_size=WIDTH, lookup_impl="reference")


class TinyEngramLM(nnx.Module):
    """Embedding -> residual + Engram delta -> linear head; all NNX except the bridged Engram."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        # Linen modules need a sample input to create their variables: lazy_init runs it once.
        sample_h = jnp.zeros((1, 1, WIDTH), jnp.float32)
        sample_ids = jnp.zeros((1, 1, CFG.num_heads_total), jnp.int32)
        # Engram's params carry logical axis names ("engram_rows", "embed", ...) for v41jax's
        # sharding rules. NNX would shard such variables eagerly, which needs a mesh; without
        # one, keep the names as metadata only.
        with nnx.use_eager_sharding(False):
            engram = bridge.ToNNX(linen_engram(), rngs=rngs)
            self.engram = engram.lazy_init(sample_h, sample_ids)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def residual(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(h: the residual stream before Engram [B, T, D], the Engram delta [B, T, D])."""
        h = self.embed(tokens)
        hash_ids = ngram_hash_ids_jax(tokens, LAYER_ID, CFG)  # int32 [B, T, H]
        return h, self.engram(h, hash_ids)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h, delta = self.residual(tokens)
        return self.head(h + delta)


def engram_params(model: TinyEngramLM) -> dict[str, jax.Array]:
    """The bridged module's variables as a plain Linen params dict (unboxed arrays)."""
    pure = nnx.to_pure_dict(nnx.state(model.engram, nnx.Param))
    return {name: jnp.asarray(value) for name, value in pure.items()}


def next_token_loss(model: TinyEngramLM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: TinyEngramLM, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss


def main(batch: int = 2, length: int = 12, seed: int = 0) -> dict:
    """Build the model, run it, take one training step. Returns arrays for checking:
    tokens, hash_ids, h (the residual before Engram), delta (the bridged Engram's output),
    logits, the Engram params before the step (a Linen params dict), the step's loss, and
    the table rows the step changed / the rows the batch addressed."""
    model = TinyEngramLM(rngs=nnx.Rngs(seed))
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, VOCAB, jnp.int32)
    h, delta = model.residual(tokens)
    logits = model(tokens)
    params_before = engram_params(model)

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss = train_step(model, optimizer, tokens)
    table_after = engram_params(model)["table"]
    changed = np.flatnonzero(np.any(np.asarray(table_after != params_before["table"]), axis=1))
    # The step's loss reads positions 0..T-2, so those are the rows it addressed.
    ids = ngram_hash_ids_jax(tokens[:, :-1], LAYER_ID, CFG)
    addressed = np.unique(np.asarray(flat_row_ids(CFG, LAYER_ID, ids)))
    return dict(
        tokens=tokens,
        hash_ids=ngram_hash_ids_jax(tokens, LAYER_ID, CFG),
        h=h,
        delta=delta,
        logits=logits,
        params=params_before,
        loss=float(loss),
        changed_rows=changed,
        addressed_rows=addressed,
        table_rows=int(table_after.shape[0]),
    )


if __name__ == "__main__":
    r = main()
    print(f"residual {r['delta'].shape}, logits {r['logits'].shape}, loss {r['loss']:.4f}")
    print(
        f"one step changed {r['changed_rows'].size} of {r['table_rows']} table rows; "
        f"the batch addressed {r['addressed_rows'].size}: "
        f"{'the same rows' if np.array_equal(r['changed_rows'], r['addressed_rows']) else 'DIFF'}"
    )
