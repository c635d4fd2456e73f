"""Hugging Face model directories (config.json + safetensors, one file or sharded with
`model.safetensors.index.json`) read into v41jax params and written back.

Reading goes tensor by tensor (`safetensors.safe_open`, memory-mapped): each tensor is
converted (`v41jax.hf.convert`), the layers are stacked into the config's layout, and each
parameter is placed into its sharding with `jax.make_array_from_callback`, so every device
receives only its own slice. The host holds one copy of the model while it is assembled
(not one per device); reading a layer-stacked parameter straight from the files per shard
would lower that to one parameter, and is not done yet.
Writing is the inverse (one file per `max_shard_bytes`, an index when there are several).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from v41jax.config import ModelConfig
from v41jax.hf.convert import hf_config_from_model, hf_tensors, model_config_from_hf, v41jax_name
from v41jax.model.layout import convert_layout, layer_segments, unscanned_segments

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# buffers some checkpoints carry that are recomputed, not learned
_SKIPPED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{hf_dir} holds no Hugging Face model (no config.json)")
    with open(path) as f:
        return json.load(f)


def tensor_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: file path} from the index, or of the single model.safetensors."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    single = os.path.join(hf_dir, SINGLE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")
    with safe_open(single, "np") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (not a dict)


def _read(files: dict[str, str]):
    """Yield (name, numpy array) file by file, each file opened once."""
    by_file: dict[str, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, "np") as f:
            for name in names:
                yield name, f.get_tensor(name)


def _per_layer_abstract(cfg: ModelConfig):
    """ShapeDtypeStructs of `cfg`'s params in the per-layer ("block_i") layout."""
    from flax import linen as nn

    from v41jax.model import init_params  # the model's own param tree, abstractly

    unscanned = dataclasses.replace(cfg, scan_layers=False)
    return jax.eval_shape(lambda: nn.unbox(init_params(unscanned, jax.random.key(0))))


def load_hf_params(hf_dir: str, cfg: ModelConfig, shardings: Any = None, dtype=None) -> dict:
    """The params of the HF model in `hf_dir` for `cfg` (`model_config_from_hf` of its
    config, possibly with overrides), in `cfg`'s layer layout; placed into `shardings` (a
    tree like the params, e.g. `make_state_fns(...)[3].params`) when given, else numpy.
    `dtype` casts every tensor (default: cfg.param_dtype). A tensor with no mapping, a
    missing one or one of the wrong shape raises ValueError naming it."""
    dtype = np.dtype(dtype or cfg.param_dtype)
    abstract = {
        "/".join(k): v for k, v in traverse_util.flatten_dict(_per_layer_abstract(cfg)).items()
    }
    want = set(abstract)
    flat: dict[str, np.ndarray] = {}
    tied_head = None
    for name, array in _read(tensor_files(hf_dir)):
        if _SKIPPED.search(name):
            continue
        mapped = v41jax_name(name)
        if mapped is None:
            raise ValueError(f"{hf_dir}: tensor {name!r} {array.shape} has no v41jax mapping")
        path, to = mapped
        if path == "head" and cfg.tie_embeddings:
            tied_head = array  # some tied checkpoints store it too: it must equal the embedding
            continue
        try:
            flat[path] = np.asarray(to(array, cfg), dtype)
        except ValueError as e:
            raise ValueError(
                f"{hf_dir}: tensor {name!r} {array.shape} does not fit the model "
                f"(d_model={cfg.d_model}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
                f"head_dim={cfg.resolved_head_dim}): {e}"
            ) from None
    if tied_head is not None and not np.array_equal(tied_head, flat.get("embed/embedding")):
        raise ValueError(f"{hf_dir}: tie_word_embeddings but lm_head.weight != embed_tokens")
    if missing := sorted(want - set(flat)):
        raise ValueError(f"{hf_dir}: no tensor for v41jax params {missing[:6]}")
    if extra := sorted(set(flat) - want):
        raise ValueError(f"{hf_dir}: tensors for params the model lacks {extra[:6]}")
    for path, x in flat.items():
        shape = abstract[path].shape
        if x.shape != shape:
            raise ValueError(f"{hf_dir}: {path} has shape {x.shape}, the model wants {shape}")
    tree = convert_layout(traverse_util.unflatten_dict(flat, sep="/"), layer_segments(cfg))
    if shardings is None:
        return tree
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx]),
        tree,
        shardings,
    )


def load_hf(hf_dir: str, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, numpy params) of an HF model directory (`overrides`: ModelConfig
    fields, e.g. max_seq_len=2048 or scan_layers=False)."""
    cfg = model_config_from_hf(read_hf_config(hf_dir), **overrides)
    return cfg, load_hf_params(hf_dir, cfg)


def save_hf(
    params: Any, cfg: ModelConfig, family: str, out_dir: str, max_shard_bytes: int = 5 << 30
) -> list[str]:
    """Write `params` (any layer layout; device or numpy arrays) as an HF `family` model
    directory: config.json, safetensors files of at most `max_shard_bytes` (a tensor is
    never split) and an index when there are several. Returns the files written."""
    hf_config = hf_config_from_model(cfg, family)
    per_layer = convert_layout(params, unscanned_segments(cfg.num_layers))
    flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(per_layer).items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in hf_tensors(flat, cfg):
        array = np.ascontiguousarray(jax.device_get(array))
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, tensors in zip(names, shards, strict=True):
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
    if n > 1:
        total = sum(a.nbytes for s in shards for a in s.values())
        weight_map = {t: name for name, s in zip(names, shards, strict=True) for t in s}
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return ["config.json", *names, *([INDEX] if n > 1 else [])]
