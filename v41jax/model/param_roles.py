"""What each parameter of the model is, for optimizers that treat kinds of weight differently.

An optimizer recipe such as DeepSeek-V4.1's (`optim.recipe`, `v41jax.train.optimizer`) needs
facts only the model knows: which leaves are linear maps and which of their axes are the
input and the output features (the rest being layers of a scanned stack, experts, attention
heads or Engram branches, each its own matrix), which are the token embedding and the output
head (rows = token ids), which are the Engram tables. `param_role(path, shape)` states them
for every param the model builds:

    role       leaves (path ends)                                  matrix axes (in, out)
    embedding  embed/embedding        [V, D]                       rows = axis 0
    head       head                   [D, V]                       rows = axis -1
    table      engram/table           [R, C]                       rows = axis 0
    matrix     attn/q, attn/k         [.., D, H, hd]               (D,), (hd,): per head
               attn/v                 [.., D, Hkv, hd]             (D,), (Hkv, hd)
               attn/o                 [.., H, hd, D]               (H, hd), (D,)
               ffn w_gate/w_up/w_down, ffn/router, engram/w_v,
               mhc phi                [.., in, out]                (in,), (out,)
               engram/w_k             [.., in, branches, out]      (in,), (out,): per branch
    vector     norms' scales, biases, mHC gates (alpha), Engram norms and key/value biases
    other      anything else (e.g. the Engram short convolution's kernel)

Leading axes not named (a scanned stack's layer axis, MoE experts) are batch axes: each slice
is its own matrix. Axes are returned non-negative for the leaf's own rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Role = Literal["embedding", "head", "table", "matrix", "vector", "other"]

# trailing-axis layouts of the linear maps, by leaf name (in axes, out axes, from the end)
_MATRIX_TAILS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "q": ((-3,), (-1,)),
    "k": ((-3,), (-1,)),
    "v": ((-3,), (-2, -1)),
    "o": ((-3, -2), (-1,)),
    "w_gate": ((-2,), (-1,)),
    "w_up": ((-2,), (-1,)),
    "w_down": ((-2,), (-1,)),
    "router": ((-2,), (-1,)),
    "w_v": ((-2,), (-1,)),
    "w_k": ((-3,), (-1,)),
    "phi": ((-2,), (-1,)),
}
_MATRIX_PARENTS = {
    "q": "attn",
    "k": "attn",
    "v": "attn",
    "o": "attn",
    "w_v": "engram",
    "w_k": "engram",
}
_VECTOR_LEAVES = {
    *("scale", "bias", "alpha", "norm_scale", "b_k", "b_v"),
    *("q_bias", "k_bias", "v_bias", "key_norm", "query_norm", "conv_norm"),
}


@dataclass(frozen=True)
class ParamRole:
    """role: what the leaf is (module doc). in_axes / out_axes: a matrix's input and output
    feature axes (empty for the other roles); rows_axis: the token-id (row) axis of an
    embedding, head or table, else None."""

    role: Role
    in_axes: tuple[int, ...] = ()
    out_axes: tuple[int, ...] = ()
    rows_axis: int | None = None


def param_role(path: Sequence[str], shape: Sequence[int]) -> ParamRole:
    """The role of the param at `path` (its keys, e.g. ("layers_0_3", "attn", "q")) of
    shape `shape` (module doc's table)."""
    keys = [str(p) for p in path]
    leaf, parent, ndim = keys[-1], (keys[-2] if len(keys) > 1 else ""), len(shape)
    if keys[-2:] == ["embed", "embedding"]:
        return ParamRole("embedding", rows_axis=0)
    if keys == ["head"]:
        return ParamRole("head", rows_axis=ndim - 1)
    if keys[-2:] == ["engram", "table"]:
        return ParamRole("table", rows_axis=0)
    if leaf in _MATRIX_TAILS and _MATRIX_PARENTS.get(leaf, parent) == parent:
        ins, outs = _MATRIX_TAILS[leaf]
        if ndim < len(ins) + len(outs):
            raise ValueError(f"param {'/'.join(keys)} has shape {tuple(shape)}: too few axes")
        return ParamRole("matrix", tuple(ndim + a for a in ins), tuple(ndim + a for a in outs))
    if leaf in _VECTOR_LEAVES:
        return ParamRole("vector")
    return ParamRole("other")
