"""Named rematerialisation policies for the decoder blocks (`ModelConfig.remat_policy`).

A policy decides which values of a block's forward pass are kept for the backward pass; the
rest are recomputed from the block's input (`jax.checkpoint`, applied as `nn.remat` around
each block, inside the layer scan when layers are scanned):

  "none"                              no remat: every residual the backward pass needs is kept
  "full"                              keep nothing but the block's inputs (recompute the block)
  "dots_saveable"                     keep every matmul output (`checkpoint_policies.dots_saveable`)
  "dots_with_no_batch_dims_saveable"  keep matmul outputs without batch dims (the weight
                                      matmuls; attention's batched score/value dots recompute)
  "save_qkv_proj"                     keep the values tagged QUERY_PROJ / KEY_PROJ / VALUE_PROJ
  "save_out_proj"                     keep the values tagged ATTN_OUT / FFN_OUT (the sub-layer
                                      outputs added to the residual stream)

Tags are `jax.ad_checkpoint.checkpoint_name(x, name)` calls; `Block` tags its attention and
FFN outputs. The q/k/v projections are tagged inside `Attention` (with the names below).
Remat never changes values: every policy computes the same forward pass and gradients.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from v41jax.config import REMAT_POLICIES

QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"
ATTN_OUT, FFN_OUT = "attn_out", "ffn_out"

_CP = jax.checkpoint_policies
_POLICIES: dict[str, Any] = {
    "full": None,  # jax.checkpoint's default: nothing saveable
    "dots_saveable": _CP.dots_saveable,
    "dots_with_no_batch_dims_saveable": _CP.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": _CP.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
    "save_out_proj": _CP.save_only_these_names(ATTN_OUT, FFN_OUT),
}


def checkpoint_policy(name: str) -> Any:
    """The `jax.checkpoint` policy of remat policy `name` (None = save nothing; "none" has no
    policy because it does not remat: check `name != "none"` first)."""
    if name not in REMAT_POLICIES or name == "none":
        raise ValueError(f"remat policy {name!r} has no checkpoint policy; known: {REMAT_POLICIES}")
    return _POLICIES[name]


def remat_block(cls: type[nn.Module], name: str, *, scanned: bool) -> type[nn.Module]:
    """`cls` wrapped in `nn.remat` under policy `name` ("none": `cls` itself).

    scanned: the module is a layer-scan body. CSE prevention is then off (the scan's loop
    already keeps XLA from merging the recomputation into the forward pass, and the
    optimisation barrier would only cost fusion), as the `jax.checkpoint` docs advise.
    """
    if name == "none":
        return cls
    return nn.remat(cls, policy=checkpoint_policy(name), prevent_cse=not scanned)


def tag(x: jax.Array, name: str) -> jax.Array:
    """Name `x` for the save_* policies (identity outside `jax.checkpoint`)."""
    return checkpoint_name(x, name)
