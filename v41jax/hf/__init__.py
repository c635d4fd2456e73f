"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 configs and
safetensors weights as v41jax `ModelConfig`s and params (`convert`, `checkpoint`)."""

from v41jax.hf.checkpoint import load_hf, load_hf_params, read_hf_config, save_hf
from v41jax.hf.convert import FAMILIES, hf_config_from_model, model_config_from_hf

__all__ = ["FAMILIES", "hf_config_from_model", "load_hf", "load_hf_params",
           "model_config_from_hf", "read_hf_config", "save_hf"]  # fmt: skip
