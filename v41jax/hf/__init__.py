"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 configs and
safetensors weights as v41jax `ModelConfig`s and params (`convert`, `checkpoint`), and as
workdirs (`workdir`: `python -m v41jax import-hf` / `export-hf`). The names below load on
first use, so `v41jax.hf.cli` (imported by the command line) pulls in no jax."""

import importlib

_EXPORTS = {
    "FAMILIES": "convert",
    "hf_config_from_model": "convert",
    "model_config_from_hf": "convert",
    "load_hf": "checkpoint",
    "load_hf_params": "checkpoint",
    "read_hf_config": "checkpoint",
    "save_hf": "checkpoint",
    "check_hf_dir": "checkpoint",
    "import_hf": "workdir",
    "export_hf": "workdir",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'v41jax.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"v41jax.hf.{_EXPORTS[name]}"), name)
