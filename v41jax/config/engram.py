"""`EngramConfig`: the hashed n-gram memory's sizes, seeds and placement.

Field names follow the public Engram demo so configs carry over. `layer_ids` empty means the
model has no Engram; the backbone puts `h <- h + Engram(h, ids)` before attention at each
listed layer.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

TableDtype = Literal["float32", "bfloat16", "float8_e4m3fn"]
TablePlacement = Literal["device", "host"]
TABLE_DTYPES = typing.get_args(TableDtype)
TABLE_PLACEMENTS = typing.get_args(TablePlacement)


@dataclass(frozen=True)
class EngramConfig:
    """Sizes and placement of the Engram memory.

    engram_vocab_size: minimum table size per n-gram order (orders 2..max_ngram_size); each
        head gets the next unused prime above it (so one prime per (layer, order, head)).
    max_ngram_size: largest n-gram order N (2..5); orders 2..N are hashed.
    n_embed_per_ngram: embedding width per order (split evenly over its heads).
    n_head_per_ngram: hash heads per order (K).
    layer_ids: backbone layers (0-based) with an Engram module; () = none.
    pad_id: compressed id used to left-pad the shifted streams (and at segment starts).
    seed: multiplier seed; layer l uses numpy default_rng(seed + 10007 * l).
    compressed_vocab_size: V' of the compressed tokenizer; bounds the multipliers. 0 until
        known: the training loop fills it from the data's compression table.
    kernel_size: short causal conv width (dilation = max_ngram_size), if used.
    use_short_conv: the paper's zero-initialised conv; V4.1 dropped it (default False).
    table_dtype: storage of the embedding tables (float8_e4m3fn adds a per-row scale).
    reset_at_segments: n-gram context restarts at document starts (pads as if the document
        began there) instead of spanning packed documents.
    table_lr_scale, table_weight_decay: the tables' optimizer group (paper: Adam at 5x LR,
        no weight decay).
    table_momentum: mu of the Sinkhorn-balanced table update's Nesterov momentum
        (`optim.table_optimizer` "sinkhorn" / "sinkhorn_sparse").
    table_placement: "device" (a param of the model) or "host" (numpy arrays in host memory:
        the input pipeline gathers each batch's rows, the device step returns their
        gradients, the host applies the row-sparse update; needs a sparse
        optim.table_optimizer). The table and its optimizer state never become device arrays.
    table_path: with table_placement "host", keep the tables and their optimizer states in
        memory-mapped files in this directory (relative: inside the workdir) instead of RAM,
        so they may exceed it ("" = in RAM). Checkpoints are the files' dirty-row logs.
    table_row_align: a layer's table stores its sum-of-primes rows rounded up to a multiple of
        this, so it row-shards evenly over any power-of-two shard count up to it; the padding
        rows are never addressed (and so never trained).
    """

    engram_vocab_size: tuple[int, ...] = (646_400, 646_400)
    max_ngram_size: int = 3
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    layer_ids: tuple[int, ...] = ()
    pad_id: int = 0
    seed: int = 0
    compressed_vocab_size: int = 0
    kernel_size: int = 4
    use_short_conv: bool = False
    table_dtype: TableDtype = "float32"
    reset_at_segments: bool = True
    table_lr_scale: float = 5.0
    table_weight_decay: float = 0.0
    table_momentum: float = 0.95
    table_row_align: int = 128
    table_placement: TablePlacement = "device"
    table_path: str = ""

    def __post_init__(self):
        validate_engram(self)

    @property
    def enabled(self) -> bool:
        return bool(self.layer_ids)

    @property
    def orders(self) -> tuple[int, ...]:
        return tuple(range(2, self.max_ngram_size + 1))

    @property
    def num_heads_total(self) -> int:
        """Ids per position: (max_ngram_size - 1) * n_head_per_ngram, order-major then head."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def embed_dim(self) -> int:
        """Width of the concatenated memory vector e_t: (max_ngram_size - 1) * n_embed."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram


def validate_engram(cfg: EngramConfig) -> None:
    """Raise ValueError naming the field and value for an inconsistent EngramConfig."""

    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"EngramConfig: {msg}")

    require(2 <= cfg.max_ngram_size <= 5, f"max_ngram_size={cfg.max_ngram_size} must be in 2..5")
    require(
        len(cfg.engram_vocab_size) == cfg.max_ngram_size - 1,
        f"engram_vocab_size={cfg.engram_vocab_size} needs one size per order 2.."
        f"{cfg.max_ngram_size} ({cfg.max_ngram_size - 1} values)",
    )
    for n, size in zip(cfg.orders, cfg.engram_vocab_size, strict=True):
        require(size >= 2, f"engram_vocab_size for order {n} is {size}; must be >= 2")
    require(cfg.n_head_per_ngram >= 1, f"n_head_per_ngram={cfg.n_head_per_ngram} must be >= 1")
    require(
        cfg.n_embed_per_ngram > 0 and cfg.n_embed_per_ngram % cfg.n_head_per_ngram == 0,
        f"n_embed_per_ngram={cfg.n_embed_per_ngram} must be a positive multiple of "
        f"n_head_per_ngram={cfg.n_head_per_ngram}",
    )
    require(len(set(cfg.layer_ids)) == len(cfg.layer_ids), f"layer_ids={cfg.layer_ids} repeat")
    require(all(i >= 0 for i in cfg.layer_ids), f"layer_ids={cfg.layer_ids} must be >= 0")
    require(cfg.table_row_align >= 1, f"table_row_align={cfg.table_row_align} must be >= 1")
    require(
        cfg.table_placement in TABLE_PLACEMENTS,
        f"table_placement={cfg.table_placement!r} not in {TABLE_PLACEMENTS}",
    )
    require(
        not cfg.table_path or cfg.table_placement == "host",
        f"table_path={cfg.table_path!r} needs table_placement='host', not {cfg.table_placement!r}",
    )
    require(0.0 <= cfg.table_momentum < 1.0, f"table_momentum={cfg.table_momentum} not in [0, 1)")
    require(cfg.kernel_size >= 1, f"kernel_size={cfg.kernel_size} must be >= 1")
    require(
        cfg.table_dtype in TABLE_DTYPES, f"table_dtype={cfg.table_dtype!r} not in {TABLE_DTYPES}"
    )
    require(
        cfg.compressed_vocab_size >= 0,
        f"compressed_vocab_size={cfg.compressed_vocab_size} must be >= 0 (0: taken from the "
        "data pipeline's compression table)",
    )
    if cfg.compressed_vocab_size:
        require(
            0 <= cfg.pad_id < cfg.compressed_vocab_size,
            f"pad_id={cfg.pad_id} must be a compressed id in [0, {cfg.compressed_vocab_size})",
        )


def require_vocab(cfg: EngramConfig) -> int:
    """V' for hashing; a clear error when the config has not been given it yet."""
    if cfg.compressed_vocab_size < 1:
        raise ValueError(
            "EngramConfig.compressed_vocab_size is 0: set it to V' of the compressed tokenizer "
            "(CompressionTable.compressed_vocab_size) before hashing"
        )
    return cfg.compressed_vocab_size
