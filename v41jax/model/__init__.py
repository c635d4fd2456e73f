"""The backbone: decoder-only transformer, its pure-JAX cores, sampling and generation."""

from v41jax.model.attention import (
    Attention,
    KVCache,
    attention_reference,
    causal_attention,
    make_attention_mask,
    update_cache,
)
from v41jax.model.generate import DecodeState, decode_step, generate, init_cache, prefill
from v41jax.model.layers import (
    Embed,
    RMSNorm,
    SwiGLU,
    apply_rope,
    rms_norm,
    rope_angles,
    swiglu,
)
from v41jax.model.sampling import check_sampling_args, sample_logits, sampling_probs
from v41jax.model.speculative import SpeculativeOutput, speculative_generate
from v41jax.model.transformer import (
    ENGRAM_IDS_PREFIX,
    FFN_KINDS,
    Block,
    BlockInputs,
    ModelOutput,
    Transformer,
    count_params,
    engram_ids_key,
    init_params,
    make_ffn,
    model_flops_per_token,
)

__all__ = [
    "DecodeState",
    "ENGRAM_IDS_PREFIX",
    "engram_ids_key",
    "FFN_KINDS",
    "Attention",
    "Block",
    "BlockInputs",
    "Embed",
    "KVCache",
    "ModelOutput",
    "RMSNorm",
    "SpeculativeOutput",
    "SwiGLU",
    "Transformer",
    "apply_rope",
    "attention_reference",
    "causal_attention",
    "check_sampling_args",
    "count_params",
    "decode_step",
    "generate",
    "init_cache",
    "init_params",
    "make_attention_mask",
    "make_ffn",
    "model_flops_per_token",
    "prefill",
    "rms_norm",
    "rope_angles",
    "sample_logits",
    "sampling_probs",
    "speculative_generate",
    "swiglu",
    "update_cache",
]
