"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 configs and weights <-> v41jax's.

The four families share one architecture, which is v41jax's `Transformer`: pre-norm blocks
of RMSNorm -> GQA attention with rotate-half RoPE -> residual, RMSNorm -> SwiGLU FFN ->
residual, a final RMSNorm and a (tied or untied) LM head. They differ in what this module
maps: RoPE theta, head_dim (Qwen3's need not be d_model / heads), q/k/v biases (Qwen2:
`attention_bias`) and per-head q/k RMSNorms before RoPE (Qwen3: `qk_norm`). A config field
that would change the function in a way v41jax does not compute (RoPE scaling, sliding
windows, an o_proj or MLP bias, another activation) is refused with its name and value,
never ignored.

Weights, per layer i (HF Linear weights are [out, in]; v41jax's einsum params [in, ...]):

    model.layers.i.self_attn.q_proj.weight [H*K, D]  -> block_i/attn/q [D, H, K]
    model.layers.i.self_attn.{k,v}_proj.weight [G*K, D] -> block_i/attn/{k,v} [D, G, K]
    model.layers.i.self_attn.o_proj.weight [D, H*K]  -> block_i/attn/o [H, K, D]
    model.layers.i.self_attn.{q,k,v}_proj.bias       -> block_i/attn/{q,k,v}_bias [., K]
    model.layers.i.self_attn.{q,k}_norm.weight [K]   -> block_i/attn/{q,k}_norm/scale
    model.layers.i.{input,post_attention}_layernorm.weight -> block_i/{attn,ffn}_norm/scale
    model.layers.i.mlp.{gate,up}_proj.weight [F, D]  -> block_i/ffn/w_{gate,up} [D, F]
    model.layers.i.mlp.down_proj.weight [D, F]       -> block_i/ffn/w_down [F, D]
    model.embed_tokens.weight [V, D], model.norm.weight, lm_head.weight [V, D] -> embed/
        embedding, final_norm/scale, head [D, V] (absent when tied)

These are the per-layer ("block_i") names; `v41jax.model.convert_layout` stacks them into a
scanned model's "layers_a_b" runs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from v41jax.config import ModelConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# fields read elsewhere or that do not change the function
_IGNORED = {
    "architectures",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "initializer_range",
    "transformers_version",
    "use_cache",
    "model_type",
    "max_window_layers",
    "pretraining_tp",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "head_dim",
    "tie_word_embeddings",
    "num_key_value_heads",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "_name_or_path",
    "tokenizer_class",
    "generation_config",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token",
    "eos_token",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
}


def _refuse(field: str, value, why: str):
    raise ValueError(f"unsupported Hugging Face config field {field}={value!r}: {why}")


def _rope_theta(hf: dict) -> float:
    """theta from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params is not None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            _refuse("rope_parameters.rope_type", kind, "only unscaled RoPE is implemented")
        return float(params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling")
    if scaling:
        _refuse("rope_scaling", scaling, "only unscaled RoPE is implemented")
    return float(hf.get("rope_theta", 10000.0))


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config.json (a dict); `overrides` replace fields
    after the mapping (e.g. max_seq_len, compute_dtype). Unknown or unsupported fields raise
    ValueError naming them."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        _refuse("model_type", family, f"supported families: {', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "the FFN is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        _refuse("mlp_bias", True, "the FFN has no biases")
    bias = bool(hf.get("attention_bias", family == "qwen2"))
    if bias and family != "qwen2":  # Llama's flag also puts a bias on o_proj
        _refuse("attention_bias", True, f"{family}'s flag adds an o_proj bias, which v41jax lacks")
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if hf.get("use_sliding_window"):
            _refuse("use_sliding_window", True, "attention is full (no sliding window)")
    elif window is not None:
        _refuse("sliding_window", window, "attention is full (no sliding window)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        _refuse("layer_types", sorted(layer_types), "every layer has full attention")
    unknown = sorted(k for k in hf if k not in _IGNORED and not k.startswith("_"))
    if unknown:
        _refuse(unknown[0], hf[unknown[0]], f"not a field v41jax reads (unknown: {unknown})")
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=d,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=h,
        num_kv_heads=int(hf.get("num_key_value_heads") or h),
        head_dim=int(hf.get("head_dim") or d // h),
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=family == "qwen3",
    )
    return dataclasses.replace(cfg, **overrides)


def hf_config_from_model(cfg: ModelConfig, family: str) -> dict:
    """A config.json dict for `cfg` in `family` (the inverse of `model_config_from_hf`)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: one of {FAMILIES}")
    if cfg.attention_bias != (family == "qwen2") or cfg.qk_norm != (family == "qwen3"):
        raise ValueError(
            f"a model with attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm} is not "
            f"a {family} model (qwen2 has the biases, qwen3 the q/k norms, the others neither)"
        )
    if cfg.engram.enabled or cfg.mhc.n_streams or cfg.moe.num_experts:
        raise ValueError(f"{family} has no Engram, mHC or MoE: export a plain model")
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype,
    }
    if family == "qwen2":
        out["attention_bias"] = True  # transformers' Qwen2 ignores it; explicit for readers
    return out


# (HF name pattern, v41jax path with {i}, to_v41jax(array, cfg), to_hf(array, cfg))
Rule = tuple[str, str, Callable, Callable]


def _heads(n: Callable[[ModelConfig], int]):
    """[n*K, D] <-> [D, n, K] (q, k, v projections)."""
    to = lambda w, c: w.reshape(n(c), c.resolved_head_dim, c.d_model).transpose(2, 0, 1)  # noqa: E731
    back = lambda w, c: w.transpose(1, 2, 0).reshape(-1, c.d_model)  # noqa: E731
    return to, back


def _bias(n: Callable[[ModelConfig], int]):
    return (lambda b, c: b.reshape(n(c), c.resolved_head_dim), lambda b, c: b.reshape(-1))


_H, _G = (lambda c: c.num_heads), (lambda c: c.num_kv_heads)
_SAME = (lambda w, c: w, lambda w, c: w)
_T = (lambda w, c: w.T, lambda w, c: w.T)
_O = (
    lambda w, c: w.T.reshape(c.num_heads, c.resolved_head_dim, c.d_model),
    lambda w, c: w.reshape(-1, c.d_model).T,
)
_L = r"model\.layers\.(\d+)\."
RULES: tuple[Rule, ...] = (
    (_L + r"self_attn\.q_proj\.weight", "block_{i}/attn/q", *_heads(_H)),
    (_L + r"self_attn\.k_proj\.weight", "block_{i}/attn/k", *_heads(_G)),
    (_L + r"self_attn\.v_proj\.weight", "block_{i}/attn/v", *_heads(_G)),
    (_L + r"self_attn\.o_proj\.weight", "block_{i}/attn/o", *_O),
    (_L + r"self_attn\.q_proj\.bias", "block_{i}/attn/q_bias", *_bias(_H)),
    (_L + r"self_attn\.k_proj\.bias", "block_{i}/attn/k_bias", *_bias(_G)),
    (_L + r"self_attn\.v_proj\.bias", "block_{i}/attn/v_bias", *_bias(_G)),
    (_L + r"self_attn\.q_norm\.weight", "block_{i}/attn/q_norm/scale", *_SAME),
    (_L + r"self_attn\.k_norm\.weight", "block_{i}/attn/k_norm/scale", *_SAME),
    (_L + r"input_layernorm\.weight", "block_{i}/attn_norm/scale", *_SAME),
    (_L + r"post_attention_layernorm\.weight", "block_{i}/ffn_norm/scale", *_SAME),
    (_L + r"mlp\.gate_proj\.weight", "block_{i}/ffn/w_gate", *_T),
    (_L + r"mlp\.up_proj\.weight", "block_{i}/ffn/w_up", *_T),
    (_L + r"mlp\.down_proj\.weight", "block_{i}/ffn/w_down", *_T),
    (r"model\.embed_tokens\.weight", "embed/embedding", *_SAME),
    (r"model\.norm\.weight", "final_norm/scale", *_SAME),
    (r"lm_head\.weight", "head", *_T),
)
_COMPILED = [(re.compile(p + "$"), path, to, back) for p, path, to, back in RULES]


def v41jax_name(hf_name: str) -> tuple[str, Callable] | None:
    """(v41jax path, its transform) of an HF tensor name; None for a name with no rule."""
    for pattern, path, to, _ in _COMPILED:
        m = pattern.match(hf_name)
        if m:
            return path.format(i=m.group(1) if m.groups() else ""), to
    return None


def hf_tensors(params: dict, cfg: ModelConfig):
    """Yield (HF name, numpy array) for per-layer v41jax `params` ('/'-joined path -> array);
    the head is left out of a tied model, as `save_pretrained` does."""
    for pattern, path, _, back in _COMPILED:
        template = pattern.pattern.rstrip("$").replace(r"(\d+)", "{i}").replace("\\", "")
        layers = range(cfg.num_layers) if "{i}" in path else [None]
        for i in layers:
            key = path.format(i=i)
            if key in params:
                yield template.format(i=i), back(np.asarray(params[key]), cfg)
