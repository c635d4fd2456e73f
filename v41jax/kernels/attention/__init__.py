"""Causal grouped-query attention: reference, blockwise XLA, cuDNN and Pallas TPU paths.

`attend(q, k, v, layout, impl=...)` is the entry point (see `api.py` for the dispatch).
"""

from v41jax.kernels.attention.api import IMPLS, attend
from v41jax.kernels.attention.blockwise import blockwise_attention
from v41jax.kernels.attention.common import AttentionLayout, index_causal
from v41jax.kernels.attention.dot_product import (
    cudnn_limits,
    cudnn_version,
    dot_product_attention,
)
from v41jax.kernels.attention.reference import (
    attention_reference,
    causal_attention,
    make_attention_mask,
)
from v41jax.kernels.attention.splash import splash_attention, splash_kernel_attention

__all__ = [
    "IMPLS",
    "AttentionLayout",
    "attend",
    "attention_reference",
    "blockwise_attention",
    "causal_attention",
    "cudnn_limits",
    "cudnn_version",
    "dot_product_attention",
    "index_causal",
    "make_attention_mask",
    "splash_attention",
    "splash_kernel_attention",
]
