"""Frozen dataclass configs, their text round-trip, and `--set a.b=value` overrides.

A run is described by one `Config`. Named configs live in `v41jax/configs/<name>.py` and any
Python file with a `get_config()` function is a config too (big_vision style). The CLI changes
single leaves with `--set section.field=value`, parsed by the field's type; a bad key names
itself and the valid ones.

The config layer sits at the bottom of the package (only `v41jax.ops` is below it) and is
plain Python: importing it loads neither jax nor flax nor any kernel, so the CLI, sweeps and
tools can build, check and print configs cheaply. Modules:
  schema  the dataclass tree (`Config` ... `GenerateConfig`) and `validate`
  engram  `EngramConfig` (the feature package `v41jax.engram` re-exports it)
  mhc     `MHCConfig` (re-exported by `v41jax.mhc`)
  text    `to_dict` / `from_dict` / `diff` / JSON files / `override` / `inline`
  named   `named_configs` / `get_config`
"""

from v41jax.config.engram import TABLE_DTYPES, EngramConfig, require_vocab, validate_engram
from v41jax.config.mhc import FORMS, RESIDUAL_KINDS, SINKHORN_VARIANTS, MHCConfig
from v41jax.config.named import CONFIG_DIR, get_config, named_configs
from v41jax.config.schema import (
    ATTENTION_IMPLS,
    DENSE_TABLE_OPTIMIZERS,
    DTYPES,
    RECIPES,
    REMAT_POLICIES,
    TABLE_OPTIMIZERS,
    Config,
    DataConfig,
    GenerateConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParamGroup,
    TrainConfig,
    validate,
)
from v41jax.config.text import (
    diff,
    from_dict,
    inline,
    load_json,
    override,
    parse_json,
    read_json,
    save_json,
    to_dict,
)

__all__ = [
    "ATTENTION_IMPLS",
    "CONFIG_DIR",
    "DTYPES",
    "FORMS",
    "REMAT_POLICIES",
    "DENSE_TABLE_OPTIMIZERS",
    "TABLE_OPTIMIZERS",
    "RECIPES",
    "RESIDUAL_KINDS",
    "SINKHORN_VARIANTS",
    "TABLE_DTYPES",
    "Config",
    "DataConfig",
    "EngramConfig",
    "GenerateConfig",
    "MHCConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParamGroup",
    "TrainConfig",
    "diff",
    "from_dict",
    "get_config",
    "inline",
    "load_json",
    "named_configs",
    "override",
    "parse_json",
    "read_json",
    "require_vocab",
    "save_json",
    "to_dict",
    "validate",
    "validate_engram",
]
