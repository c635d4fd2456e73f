"""v41jax: Engram, mHC and exact speculative decoding in JAX/Flax.

Subpackages import one way, each only from those before it (tests/test_architecture.py):
ops -> config, sharding -> data -> kernels -> engram -> mhc -> speculative -> model -> decode ->
train -> hf -> dspark -> sweep -> bench. `ops` holds the shared numerical primitives; `config`
is plain Python (no jax), so `import v41jax.config` stays cheap.

The public API below (`__all__`) is lazy: `v41jax.Engram`, `v41jax.speculative_sample`, ...
import their subpackage on first access (a module-level `__getattr__`), so `import v41jax`
itself imports no other module, and no jax. Examples of using these from other JAX code
(NNX, raw `jax.jit`, a user's own sampler, `shard_map`): examples/README.md.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # configs (plain Python)
    "Config": "config",
    "ModelConfig": "config",
    "EngramConfig": "config",
    "MHCConfig": "config",
    "get_config": "config",
    "named_configs": "config",
    "override": "config",
    # Engram: hashing, the functional pieces, the Linen module
    "Engram": "engram",
    "engram_forward": "engram",
    "engram_gate_value": "engram",
    "gather_memory": "engram",
    "default_lookup": "engram",
    "flat_row_ids": "engram",
    "ngram_hash_ids": "engram",
    "ngram_hash_ids_jax": "engram",
    "ngram_hash_ids_np": "engram",
    "ngram_hash_ids_step": "engram",
    "engram_param_shapes": "engram",
    # mHC
    "MHCResidual": "mhc",
    "mhc_params_init": "mhc",
    "mhc_coefficients": "mhc",
    "mhc_apply": "mhc",
    "expand_streams": "mhc",
    "reduce_streams": "mhc",
    "sinkhorn_knopp": "mhc",
    # speculative decoding
    "speculative_sample": "speculative",
    "audit_verifier": "speculative",
    "AuditReport": "speculative",
    # the backbone
    "Transformer": "model",
    "init_params": "model",
    # decoding
    "SamplingParams": "decode",
    "generate": "decode",
    "speculative_generate": "decode",
    "sampling_probs": "decode",
    # training and runs (the `train` function stays `v41jax.train.train`: the name is taken
    # by the subpackage)
    "load_run": "train",
    "LoadedRun": "train",
    "evaluate_run": "train",
    # Hugging Face checkpoints
    "load_hf": "hf",
    "save_hf": "hf",
    "import_hf": "hf",
    "export_hf": "hf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Resolve a public name by importing its subpackage (once; then cached in globals)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'v41jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"v41jax.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
