"""The backbone: decoder-only transformer and its pure-JAX cores (decoding: `v41jax.decode`)."""

from v41jax.engram.tree_keys import (
    ENGRAM_IDS_PREFIX,
    ENGRAM_ROWS_PREFIX,
    engram_ids_key,
    engram_rows_key,
)
from v41jax.model.accounting import (
    matmul_params_per_token,
    model_flops_per_token,
    param_accounting,
)
from v41jax.model.attention import (
    Attention,
    KVCache,
    attention_reference,
    causal_attention,
    make_attention_mask,
    update_cache,
)
from v41jax.model.block import feature_param_groups
from v41jax.model.layers import (
    Embed,
    RMSNorm,
    SwiGLU,
    apply_rope,
    rms_norm,
    rope_angles,
    swiglu,
)
from v41jax.model.layout import (
    Segment,
    convert_layout,
    layer_segments,
    scan_tree,
    unscan_tree,
)
from v41jax.model.metric import Metric, combine_metrics, metric_values
from v41jax.model.moe import (
    MoE,
    MoEStats,
    expert_capacity,
    is_moe_layer,
    moe_metrics,
    route,
    routed_experts,
)
from v41jax.model.param_roles import ParamRole, param_role
from v41jax.model.transformer import (
    FFN_KINDS,
    Block,
    BlockInputs,
    ModelOutput,
    Transformer,
    count_params,
    ffn_kind_for_layer,
    init_inputs,
    init_params,
    make_ffn,
)

__all__ = [
    "ENGRAM_IDS_PREFIX",
    "ENGRAM_ROWS_PREFIX",
    "engram_ids_key",
    "engram_rows_key",
    "FFN_KINDS",
    "Attention",
    "Block",
    "BlockInputs",
    "Embed",
    "KVCache",
    "Metric",
    "MoE",
    "MoEStats",
    "ModelOutput",
    "RMSNorm",
    "Segment",
    "SwiGLU",
    "Transformer",
    "apply_rope",
    "attention_reference",
    "causal_attention",
    "combine_metrics",
    "convert_layout",
    "count_params",
    "expert_capacity",
    "feature_param_groups",
    "ParamRole",
    "param_role",
    "ffn_kind_for_layer",
    "init_inputs",
    "init_params",
    "layer_segments",
    "make_attention_mask",
    "is_moe_layer",
    "make_ffn",
    "matmul_params_per_token",
    "metric_values",
    "model_flops_per_token",
    "moe_metrics",
    "param_accounting",
    "rms_norm",
    "rope_angles",
    "route",
    "routed_experts",
    "scan_tree",
    "swiglu",
    "unscan_tree",
    "update_cache",
]
