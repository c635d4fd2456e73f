"""Named configs: `v41jax/configs/<name>.py`, any Python file with a `get_config()` function
(big_vision style), or a run's saved `config.json`.

A named config's file may define `VARIANTS = {"engram": ["model.engram.layer_ids=1", ...]}`:
`<name>-<variant>` (e.g. `1b-engram`) is then that config with those `--set` overrides
applied, named `<name>-<variant>`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from v41jax.config.schema import Config
from v41jax.config.text import load_json, override

# The configs live next to this package: v41jax/configs/.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def named_configs() -> list[str]:
    """Every `v41jax/configs/<name>.py` and each of its `<name>-<variant>`s."""
    names = []
    for f in os.listdir(CONFIG_DIR):
        if f.endswith(".py") and not f.startswith("_"):
            names.append(f[:-3])
            names += [f"{f[:-3]}-{v}" for v in getattr(_load(_named_path(f[:-3])), "VARIANTS", {})]
    return sorted(names)


def _named_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"{name}.py")


def _load(path: str):
    """The module of a config file (executed afresh: a config may be edited between calls)."""
    spec = importlib.util.spec_from_file_location(f"_v41jax_config_{abs(hash(path))}", path)
    if spec is None:
        raise ValueError(f"config {path!r} is neither a .py file with get_config() nor a .json")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variant(name: str) -> Config | None:
    """`<base>-<variant>` from the base config's VARIANTS, or None when `name` is not one."""
    base, sep, variant = name.rpartition("-")
    if not sep or not os.path.isfile(_named_path(base)):
        return None
    variants = getattr(_load(_named_path(base)), "VARIANTS", {})
    if variant not in variants:
        raise ValueError(
            f"unknown config {name!r}: {base!r} has the variants {sorted(variants)}; "
            f"named configs: {named_configs()}"
        )
    cfg = override(get_config(base), list(variants[variant]))
    return dataclasses.replace(cfg, name=name)


def get_config(name_or_path: str) -> Config:
    """A named config (`tiny`, `small`, `1b`, `1b-engram`, ...), a path to a Python file with
    `get_config()`, or a run's saved `config.json`."""
    if name_or_path.endswith(".json"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"config file {name_or_path!r} does not exist")
        return load_json(name_or_path)
    if name_or_path.endswith(".py") or os.sep in name_or_path:
        path = name_or_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
    else:
        path = _named_path(name_or_path)
        if not os.path.isfile(path):
            if (cfg := _variant(name_or_path)) is not None:
                return cfg
            raise ValueError(f"unknown config {name_or_path!r}; named configs: {named_configs()}")
    module = _load(path)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path!r} has no get_config() function")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise TypeError(f"{path}: get_config() returned {type(cfg).__name__}, expected Config")
    return cfg
