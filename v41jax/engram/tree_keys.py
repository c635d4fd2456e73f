"""Where Engram's inputs sit in a batch and its table in a params tree.

Batch / `extras` entries of Engram layer l (the model reads them, training fills them):

    engram_ids_<l>    int32 [B, T, H]: the layer's hash ids (H = (max_ngram_size - 1) heads
                      per n-gram order), or slots into `engram_rows_<l>` when that is present
    engram_rows_<l>   [U, head_dim]: the layer's rows gathered outside the model (row-sparse
                      training, host tables); ids become slots (`table_optim.unique_rows`)

Params: each Engram layer's table is `params["block_<l>"]["engram"]["table"]` [R, C]
(Engram layers are never stacked, so the block name carries the layer index).
"""

from __future__ import annotations

from flax import traverse_util

ENGRAM_IDS_PREFIX = "engram_ids_"
# Row-sparse training and host tables: the layer's rows read outside the model, [U, head_dim];
# its `engram_ids_<layer>` then hold slots into them (v41jax.engram.table_optim.unique_rows).
ENGRAM_ROWS_PREFIX = "engram_rows_"
TABLE_LEAF = ("engram", "table")


def engram_ids_key(layer: int) -> str:
    """Key in `extras` (and in training batches) of layer `layer`'s Engram hash ids
    int32 [B, T, (max_ngram_size - 1) * n_head_per_ngram]."""
    return f"{ENGRAM_IDS_PREFIX}{layer}"


def engram_rows_key(layer: int) -> str:
    """Extras key of layer `layer`'s pre-gathered Engram rows (`ENGRAM_ROWS_PREFIX`)."""
    return f"{ENGRAM_ROWS_PREFIX}{layer}"


def engram_table_paths(params) -> dict[int, tuple]:
    """{Engram layer index: path of its table in `params`} (paths end in engram/table;
    Engram layers are never stacked, so the path's block is "block_<layer>")."""
    out = {}
    for path in traverse_util.flatten_dict(params):
        if path[-2:] == TABLE_LEAF:
            out[int(str(path[-3]).rsplit("_", 1)[-1])] = path
    return out
