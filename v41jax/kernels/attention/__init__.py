"""Causal grouped-query attention: reference, blockwise XLA, cuDNN and Pallas TPU paths."""

from v41jax.kernels.attention.api import AttentionLayout, attend
from v41jax.kernels.attention.reference import (
    attention_reference,
    causal_attention,
    make_attention_mask,
)

__all__ = [
    "AttentionLayout",
    "attend",
    "attention_reference",
    "causal_attention",
    "make_attention_mask",
]
