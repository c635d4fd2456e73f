"""Engram conditional memory: hashed n-gram ids, gated table lookup.

The config (`EngramConfig`) lives in the config layer, `v41jax.config.engram`.
"""

from v41jax.config.engram import TABLE_DTYPES, EngramConfig, require_vocab, validate_engram
from v41jax.engram.fp8 import (
    FP8_BLOCK,
    block_scales,
    dequantize_block_rows,
    dequantize_blocks,
    export_fp8_blocks,
    fake_quantize_blocks,
    fp8_block_error_bound,
    import_fp8_blocks,
    quantize_blocks,
    quantize_blocks_np,
)
from v41jax.engram.hashing import (
    layer_multipliers,
    ngram_hash_ids,
    ngram_hash_ids_jax,
    ngram_hash_ids_np,
    ngram_hash_ids_step,
    prefix_window,
    roll_window,
)
from v41jax.engram.layer import (
    Engram,
    default_lookup,
    engram_forward,
    engram_gate_value,
    export_fp8_table,
    flat_row_ids,
    gather_memory,
    short_conv,
    table_storage_dtype,
)
from v41jax.engram.params import (
    dense_param_count,
    engram_param_shapes,
    param_count,
    size_tables_for_budget,
    table_padding_count,
    table_param_count,
)
from v41jax.engram.primes import (
    head_offsets,
    is_prime,
    layer_primes,
    next_prime_above,
    stored_table_rows,
    table_rows,
    table_sizes,
)
from v41jax.engram.sharded import pad_table, sharded_lookup

__all__ = [
    "FP8_BLOCK",
    "block_scales",
    "dequantize_block_rows",
    "dequantize_blocks",
    "export_fp8_blocks",
    "fake_quantize_blocks",
    "fp8_block_error_bound",
    "import_fp8_blocks",
    "quantize_blocks",
    "quantize_blocks_np",
    "TABLE_DTYPES",
    "Engram",
    "EngramConfig",
    "default_lookup",
    "dense_param_count",
    "engram_forward",
    "engram_gate_value",
    "engram_param_shapes",
    "export_fp8_table",
    "flat_row_ids",
    "gather_memory",
    "pad_table",
    "param_count",
    "sharded_lookup",
    "short_conv",
    "size_tables_for_budget",
    "stored_table_rows",
    "table_padding_count",
    "table_param_count",
    "table_storage_dtype",
    "head_offsets",
    "is_prime",
    "layer_multipliers",
    "layer_primes",
    "next_prime_above",
    "ngram_hash_ids",
    "ngram_hash_ids_jax",
    "ngram_hash_ids_np",
    "ngram_hash_ids_step",
    "prefix_window",
    "require_vocab",
    "roll_window",
    "table_rows",
    "table_sizes",
    "validate_engram",
]
