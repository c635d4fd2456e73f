"""Engram parameter accounting and table sizing for a parameter budget (Engram, arXiv 2601.07372).

Per Engram layer l, with E = (N-1) * n_embed_per_ngram, D = hidden_size, M = branches:

    table       sum(primes_l) * head_dim           (the sparse part: almost all of it)
    value       E * D + D                          (W_V, b_V; shared by the branches)
    keys        E * M * D + M * D                  (W_K, b_K per branch)
    norms       2 * M * D                          (key and query RMSNorm scales)
    conv        M * D + kernel_size * M * D        (only with use_short_conv)

These are the trainable parameters `Engram` creates (an fp8 export's per-row scales are
not counted). The paper sizes Engram as a share of a sparse budget (~20-25% of it:
the U-shaped allocation law), so `size_tables_for_budget` turns a parameter target into
per-order table sizes.
"""

from __future__ import annotations

import dataclasses
import math

from v41jax.config.schema import ParamGroup
from v41jax.engram.config import EngramConfig
from v41jax.engram.primes import stored_table_rows, table_rows


def engram_param_shapes(
    cfg: EngramConfig, layer_id: int, hidden_size: int, num_branches: int = 1
) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of one layer's params, as `Engram` creates them."""
    e, d, m = cfg.embed_dim, hidden_size, num_branches
    shapes = {
        "table": (stored_table_rows(cfg, layer_id), cfg.head_dim),
        "w_v": (e, d),
        "b_v": (d,),
        "w_k": (e, m, d),
        "b_k": (m, d),
        "key_norm": (m, d),
        "query_norm": (m, d),
    }
    if cfg.use_short_conv:
        shapes |= {"conv_norm": (m, d), "conv_kernel": (cfg.kernel_size, m, d)}
    return shapes


def table_param_count(cfg: EngramConfig) -> int:
    """Table parameters of all Engram layers: `sum_l sum(primes_l) * head_dim` (the rows a
    hash can address; see `table_padding_count` for the alignment rows stored beside them)."""
    return sum(table_rows(cfg, layer) for layer in cfg.layer_ids) * cfg.head_dim


def table_padding_count(cfg: EngramConfig) -> int:
    """Stored but never-addressed table entries: each layer's rows are rounded up to
    `cfg.table_row_align` so the table row-shards evenly (< align rows per layer)."""
    return (
        sum(stored_table_rows(cfg, layer) - table_rows(cfg, layer) for layer in cfg.layer_ids)
        * cfg.head_dim
    )


def dense_param_count(cfg: EngramConfig, hidden_size: int, num_branches: int = 1) -> int:
    """Non-table parameters (projections, norms, conv) of all Engram layers."""
    _check_sizes(hidden_size, num_branches)
    e, d, m = cfg.embed_dim, hidden_size, num_branches
    per_layer = e * d + d + e * m * d + m * d + 2 * m * d
    if cfg.use_short_conv:
        per_layer += m * d + cfg.kernel_size * m * d
    return len(cfg.layer_ids) * per_layer


def param_count(cfg: EngramConfig, hidden_size: int, num_branches: int = 1) -> int:
    """All Engram parameters of the model: tables + projections + norms (+ conv). The module
    also stores `table_padding_count(cfg)` alignment entries, which are not parameters."""
    return table_param_count(cfg) + dense_param_count(cfg, hidden_size, num_branches)


def _check_sizes(hidden_size: int, num_branches: int) -> None:
    if hidden_size < 1 or num_branches < 1:
        raise ValueError(f"hidden_size={hidden_size} and num_branches={num_branches} must be >= 1")


def _with_size(cfg: EngramConfig, size: int) -> EngramConfig:
    return dataclasses.replace(cfg, engram_vocab_size=(size,) * len(cfg.orders))


def size_tables_for_budget(
    cfg: EngramConfig, hidden_size: int, target_params: int, num_branches: int = 1
) -> EngramConfig:
    """cfg with equal per-order `engram_vocab_size` S making `param_count` closest to target.

    With every order at S, the P = layers * (N-1) * K heads take the P smallest primes >= S,
    so the table size is non-decreasing in S and at least P * S * head_dim. A bisection finds
    the largest S whose count is <= target; S + 1 (one prime step per head further) is the
    only other candidate, and the closer of the two wins (ties: the smaller). Raises
    ValueError when cfg has no Engram layers or its non-table params alone exceed the target.
    """
    if not cfg.layer_ids:
        raise ValueError("size_tables_for_budget: EngramConfig.layer_ids is empty (no Engram)")
    dense = dense_param_count(cfg, hidden_size, num_branches)
    if dense > target_params:
        raise ValueError(
            f"size_tables_for_budget: the non-table Engram params alone are {dense:,} "
            f"({len(cfg.layer_ids)} layers, E={cfg.embed_dim}, D={hidden_size}, "
            f"M={num_branches}) > target {target_params:,}"
        )
    heads = len(cfg.layer_ids) * cfg.num_heads_total
    target_rows = (target_params - dense) / cfg.head_dim

    def rows(size: int) -> int:
        return table_param_count(_with_size(cfg, size)) // cfg.head_dim

    # Invariant: rows(lo) <= target_rows < rows(hi), since rows(S) >= heads * S.
    lo, hi = 2, max(3, math.floor(target_rows / heads) + 1)
    if rows(lo) > target_rows:  # even the smallest tables overshoot: they are the closest
        return _with_size(cfg, lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if rows(mid) <= target_rows else (lo, mid)
    best = min((lo, hi), key=lambda s: (abs(rows(s) - target_rows), s))
    return _with_size(cfg, best)


TABLE_GROUP = "engram_tables"


def table_param_group(cfg: EngramConfig, table_optimizer: str = "adam") -> ParamGroup:
    """The tables' optimizer group: the paper trains them with Adam at `table_lr_scale` x
    the base LR (5x) and no weight decay (`table_weight_decay`), while the rest of the
    model keeps its own groups; with `table_optimizer` "sinkhorn", V4.1's Sinkhorn-balanced
    momentum (`table_momentum`) at the same LR x gamma. Matches every layer's `engram/table`
    param. (The row-sparse optimizers update the tables outside optax: the group then only
    names them.)"""
    return ParamGroup(
        TABLE_GROUP,
        r"(^|/)engram/table$",
        lr_scale=cfg.table_lr_scale,
        weight_decay=cfg.table_weight_decay,
        rule="sinkhorn" if table_optimizer == "sinkhorn" else "adamw",
        momentum=cfg.table_momentum,
    )
