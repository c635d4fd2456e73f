"""Params whose Engram tables stay in host memory or on disk, for decoding and evaluation.

`tables_on_host(params, cfg)` replaces each Engram layer's `table` [R, C] in a params tree by
a `HostRows` reference (no device array), so `generate`, `speculative_generate`,
`dspark_generate` and an eval step read the rows through a host callback:

    params["block_<l>"]["engram"]["table"]:  jax.Array [R, C]  ->  HostRows(source_l)

The same call on the params' sharding tree puts the same references there, so the two trees
keep one structure (`jax.jit(in_shardings=...)` needs that).
"""

from __future__ import annotations

import numpy as np
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig
from v41jax.engram.host_rows import HostRows
from v41jax.engram.host_table import HostTable
from v41jax.engram.primes import stored_table_rows
from v41jax.engram.tree_keys import TABLE_LEAF, engram_table_paths


def engram_tables(params) -> dict[int, object]:
    """{Engram layer: its `table` leaf} of a (boxed or plain) params tree."""
    plain = nn.unbox(params)
    return {layer: _get(plain, path) for layer, path in engram_table_paths(plain).items()}


def host_rows_of(cfg: ModelConfig, sources: dict) -> dict[int, HostRows]:
    """{layer: HostRows} from {layer: HostTable | TableFile | numpy [R, C] | HostRows},
    checked against the config: every Engram layer once, rows = its stored table rows."""
    engram = cfg.engram
    if set(sources) != set(engram.layer_ids):
        raise ValueError(
            f"host tables for layers {sorted(sources)} but model.engram.layer_ids="
            f"{list(engram.layer_ids)}"
        )
    out = {}
    for layer, src in sources.items():
        rows = src if isinstance(src, HostRows) else HostRows(src)
        want = (stored_table_rows(engram, layer), engram.head_dim)
        if rows.shape != want:
            raise ValueError(
                f"host table of layer {layer} has shape {rows.shape}; this model needs {want}"
            )
        out[layer] = rows
    return out


def tables_on_host(params, cfg: ModelConfig, sources: dict | None = None):
    """`params` with every Engram table replaced by `HostRows`.

    sources: {layer: HostTable | TableFile | numpy [R, C] | HostRows}; default: the params'
    own tables copied to host memory as `HostTable`s (then dropped from the tree). Params
    without a table at a layer (host-table training drops them) get the source's. Works on a
    sharding tree too when `sources` are the HostRows already used for the params.
    """
    if sources is None:
        sources = {layer: HostTable(np.asarray(t)) for layer, t in engram_tables(params).items()}
    refs = host_rows_of(cfg, sources)
    flat = traverse_util.flatten_dict(dict(params))
    for layer, ref in refs.items():
        flat[(f"block_{layer}", *TABLE_LEAF)] = ref
    return traverse_util.unflatten_dict(flat)


def host_table_arrays(params) -> dict[int, np.ndarray]:
    """{layer: the numpy table} of params whose tables are `HostRows` over in-memory tables
    (HostTable of float32/bfloat16 rows, or numpy); raises for file-backed or FP8 ones."""
    out = {}
    for layer, ref in engram_tables(params).items():
        src = ref.source if isinstance(ref, HostRows) else None
        if isinstance(src, HostTable) and src.scale is None and src.block_exp is None:
            src = src.table
        if not isinstance(src, np.ndarray):
            raise ValueError(
                f"layer {layer}: table {ref!r} is not an in-memory float table (a file or "
                "FP8 table cannot be trained in place here)"
            )
        out[layer] = src
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree
