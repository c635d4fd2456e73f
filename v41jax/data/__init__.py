"""Data layer: corpus loading and splitting, byte-level BPE tokenizer, Engram tokenizer
compression, packed, sharded, resumable batches, and token files (memmaps read by offset).
Depends on nothing else in v41jax but `v41jax.config`."""

from v41jax.data.compression import (
    CompressionTable,
    build_compression_table,
    compress_ids,
    normalize_token_text,
)
from v41jax.data.corpus import (
    Document,
    default_cache_dir,
    default_corpus_dir,
    load_documents,
    resolve_cache_dir,
    split_documents,
)
from v41jax.data.pipeline import (
    BatchIterator,
    PreparedData,
    eval_batches,
    prepare_data,
    segment_ids_and_positions,
)
from v41jax.data.token_files import (
    DocumentIndex,
    load_data,
    load_token_dir,
    read_manifest,
    write_token_dir,
)
from v41jax.data.tokenizer import (
    EOS_ID,
    EOS_TOKEN,
    Tokenizer,
    load_or_train_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOS_ID",
    "EOS_TOKEN",
    "BatchIterator",
    "CompressionTable",
    "Document",
    "DocumentIndex",
    "PreparedData",
    "Tokenizer",
    "build_compression_table",
    "compress_ids",
    "default_cache_dir",
    "default_corpus_dir",
    "eval_batches",
    "load_data",
    "load_documents",
    "load_or_train_tokenizer",
    "load_token_dir",
    "normalize_token_text",
    "prepare_data",
    "read_manifest",
    "resolve_cache_dir",
    "segment_ids_and_positions",
    "split_documents",
    "train_tokenizer",
    "write_token_dir",
]
