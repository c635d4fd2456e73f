"""Named configs: `v41jax/configs/<name>.py`, any Python file with a `get_config()` function
(big_vision style), or a run's saved `config.json`."""

from __future__ import annotations

import importlib.util
import os

from v41jax.config.schema import Config
from v41jax.config.text import load_json

# The configs live next to this package: v41jax/configs/.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def named_configs() -> list[str]:
    return sorted(
        f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_")
    )


def get_config(name_or_path: str) -> Config:
    """A named config (`tiny`, `small`, ...), a path to a Python file with `get_config()`, or
    a run's saved `config.json`."""
    if name_or_path.endswith(".json"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"config file {name_or_path!r} does not exist")
        return load_json(name_or_path)
    if name_or_path.endswith(".py") or os.sep in name_or_path:
        path = name_or_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
    else:
        path = os.path.join(CONFIG_DIR, f"{name_or_path}.py")
        if not os.path.isfile(path):
            raise ValueError(f"unknown config {name_or_path!r}; named configs: {named_configs()}")
    spec = importlib.util.spec_from_file_location(f"_v41jax_config_{abs(hash(path))}", path)
    if spec is None:
        raise ValueError(f"config {path!r} is neither a .py file with get_config() nor a .json")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path!r} has no get_config() function")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise TypeError(f"{path}: get_config() returned {type(cfg).__name__}, expected Config")
    return cfg
