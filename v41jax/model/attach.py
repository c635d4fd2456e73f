"""Features attached to a pretrained model: new modules that start at the source's function.

Fine-tuning a model without Engram or mHC into one with them (`train.init_from` a run or an
imported Hugging Face checkpoint, plus `--set model.engram.layer_ids=...` or
`--set model.mhc.n_streams=n`) keeps every param the source has; the new modules take the
fresh init with one factor zeroed, so that at step 0 the model computes the source's
function while the zeroed factor's gradient is not zero (as a LoRA B matrix):

  Engram  the value projection W_V, b_V = 0: the delta v = alpha (e W_V + b_V) is 0.
          dL/dW_V = e^T (alpha dL/dv) is not 0, so the memory learns from the first step.
  mHC     phi = 0 in every `attn_mix` / `ffn_mix`: the coefficients are then their static
          bias (`v41jax.mhc.reference.static_bias`): H_pre = 1/n, H_post = 1, H_res with
          unit row sums. The n streams start as copies of the embedding h, and while they are
          equal each update `H_res x + H_post^T F(H_pre x)` keeps them equal to the plain
          residual `h + F(h)`. dL/dphi = v'^T (alpha dL/dcoeffs) is not 0.

Where the math does not allow an exact start, the difference is the RMSNorm eps acting
at another scale: RMSNorm(k h) = RMSNorm(h) with eps / k^2 for eps, a relative change of
about eps (1 - 1/k^2) / (2 ms(h)), ~5e-7 for a residual stream of unit mean square:
  - forms "reference" / "fused": the head's input is RMSNorm(sum of the n streams), k = n;
  - n = 1: H_pre = sigmoid(0) = 1/2, so each sub-layer sees RMSNorm(h / 2), k = 1/2;
  - n > 1 not a power of 2: 1/n and the H_res rows are also rounded in float32.
The single-pass form starts there too: its lagged pre-mapping is the same static H_pre
(layer 0: one-hot on stream 0, which is h as well) and its readout RMSNorm(H_pre X) is k = 1.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import traverse_util

# The params whose zero makes each new module the identity (see the module docstring).
_ZEROED = {"engram": ("w_v", "b_v"), "attn_mix": ("phi",), "ffn_mix": ("phi",)}


def _zeroed_at_start(path: tuple[str, ...]) -> bool | None:
    """True / False for a param of an attachable module (zero it / keep the fresh init),
    None for a path in no attachable module."""
    for module, names in _ZEROED.items():
        if module in path:
            return path[-1] in names
    return None


def attach_new_modules(source_params: dict, fresh_params: dict) -> dict:
    """The params of the new model: the source's where it has them, the attachable modules'
    (Engram, mHC mixes) from `fresh_params` with their zeroed factor at 0.

    Both trees in the new model's layer layout (`v41jax.model.convert_layout`). Raises
    ValueError naming a param the source has and the new model lacks, or one the new model
    needs that is neither in the source nor in an attachable module.
    """
    flat_src = traverse_util.flatten_dict(source_params)
    fresh_flat = traverse_util.flatten_dict(fresh_params)
    if extra := sorted("/".join(p) for p in flat_src if p not in fresh_flat):
        raise ValueError(f"attach_new_modules: the new model has no param for {extra[:4]}")
    out = {}
    for path, fresh in fresh_flat.items():
        if path in flat_src:
            if flat_src[path].shape != fresh.shape:
                raise ValueError(
                    f"attach_new_modules: {'/'.join(path)} has shape {flat_src[path].shape} "
                    f"in the source and {fresh.shape} in the new model"
                )
            out[path] = flat_src[path]
            continue
        zero = _zeroed_at_start(path)
        if zero is None:
            raise ValueError(f"attach_new_modules: the source has no param {'/'.join(path)}")
        out[path] = jnp.zeros_like(fresh) if zero else fresh
    return traverse_util.unflatten_dict(out)
