"""Pure-jnp reference of the Engram lookup (the "Embedding, gate, output" step).

The memory vector of a token is its H heads' rows of the flat table, concatenated::

    e_t = concat_h  table[ids[t, h]] * s[ids[t, h]]          e_t in R^{H*E}

with ``s`` the optional per-row FP8 scale (``s = 1`` without one). Every kernel in this
package is tested against this function, values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def engram_lookup_reference(
    table_RxE: jax.Array,
    ids_NxH: jax.Array,
    row_scale_R: jax.Array | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """``[R, E]`` table, ``[..., H]`` int row ids, optional ``[R]`` f32 scale -> ``[..., H*E]``.

    Without a scale the gathered rows are cast to ``out_dtype``; with one they are
    dequantised in float32 first (``q.astype(f32) * scale``), then cast.
    """
    rows_NxHxE = table_RxE[ids_NxH]
    if row_scale_R is not None:
        rows_NxHxE = rows_NxHxE.astype(jnp.float32) * row_scale_R[ids_NxH][..., None]
    rows_NxHxE = rows_NxHxE.astype(out_dtype)
    return rows_NxHxE.reshape(*ids_NxH.shape[:-1], ids_NxH.shape[-1] * table_RxE.shape[1])
