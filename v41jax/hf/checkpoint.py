"""Hugging Face model directories (config.json + safetensors, one file or sharded with
`model.safetensors.index.json`) read into v41jax params and written back.

Reading maps every tensor into memory (`v41jax.hf.mapped`), converts it as a view
(`v41jax.hf.convert`: reshapes and transposes), and places each parameter into its sharding
one slice at a time: each device's slice, of the layers a stacked parameter holds, is
copied straight from the files and put on its device before the next is read, so the host
never holds the model, nor a whole parameter.
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
from safetensors.numpy import save_file

from v41jax.config import ModelConfig, read_json
from v41jax.hf.convert import hf_config_from_model, hf_tensors, model_config_from_hf, v41jax_name
from v41jax.hf.mapped import mapped_tensors, read_header
from v41jax.model.layout import convert_layout, layer_segments, unscanned_segments

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# buffers some checkpoints carry that are recomputed, not learned
_SKIPPED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def read_hf_config(hf_dir: str) -> dict:
    """The config.json of the HF model directory `hf_dir`. A path that does not exist, is
    not a directory or holds no config.json, and a damaged config.json (e.g. cut short), are
    errors naming it."""
    if not os.path.exists(hf_dir):
        raise FileNotFoundError(
            f"{hf_dir} does not exist (a Hugging Face model directory: "
            "config.json + safetensors + tokenizer.json)"
        )
    if not os.path.isdir(hf_dir):
        raise ValueError(
            f"{hf_dir} is a file, not a Hugging Face model directory (config.json "
            "+ safetensors + tokenizer.json)"
        )
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{hf_dir} holds no Hugging Face model (no config.json)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a model config")
    return config


def check_hf_dir(hf_dir: str) -> None:
    """Refuse, naming what is wrong, a directory that cannot be imported: missing, without
    a readable config.json, without safetensors weights, or whose index or shards are
    missing or damaged (a header that lies, a file cut short). Cheap: it reads the JSON
    files and the headers and maps the tensors, but reads no tensor data. `load_hf_params`
    makes the same checks; this makes them before anything else (a tokenizer, a mesh)."""
    read_hf_config(hf_dir)
    _mapped(tensor_files(hf_dir))


def tensor_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: file path} from the index, or of the single model.safetensors. A
    damaged index, or one naming a shard that is not there, is an error naming both."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map {{tensor name: file}}")
        files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
        for name, path in files.items():
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{index} puts tensor {name} in {weight_map[name]}, which {hf_dir} lacks"
                )
        return files
    single = os.path.join(hf_dir, SINGLE)
    if not os.path.exists(single):
        others = sorted(f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth")))
        found = f" (only {', '.join(others[:3])}: convert to safetensors)" if others else ""
        raise FileNotFoundError(
            f"{hf_dir} has no safetensors weights: neither {INDEX} nor {SINGLE}{found}"
        )
    return {name: single for name in read_header(single)[0]}


def _mapped(files: dict[str, str]) -> dict[str, np.ndarray]:
    """{tensor name: its read-only memmap} of the tensors `files` lists (each file mapped
    once; nothing is read yet). A file that lacks a tensor the index puts in it is an error
    naming both."""
    by_file: dict[str, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        tensors = mapped_tensors(path)
        if missing := sorted(set(names) - set(tensors)):
            raise ValueError(
                f"{path} lacks tensor {missing[0]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f", which {INDEX} puts in it"
            )
        out.update((name, tensors[name]) for name in names)
    return out


def _per_layer_abstract(cfg: ModelConfig):
    """ShapeDtypeStructs of `cfg`'s params in the per-layer ("block_i") layout."""
    from flax import linen as nn

    from v41jax.model import init_params  # the model's own param tree, abstractly

    unscanned = dataclasses.replace(cfg, scan_layers=False)
    return jax.eval_shape(lambda: nn.unbox(init_params(unscanned, jax.random.key(0))))


def _sources(hf_dir: str, cfg: ModelConfig, abstract: dict) -> dict[str, Any]:
    """{per-layer v41jax path: a function () -> the converted memmap view}, every name and
    shape checked against `abstract` before any data is read."""
    sources: dict[str, Any] = {}
    tied_head = None
    for name, stored in _mapped(tensor_files(hf_dir)).items():
        if _SKIPPED.search(name):
            continue
        mapped = v41jax_name(name)
        if mapped is None:
            raise ValueError(f"{hf_dir}: tensor {name!r} {stored.shape} has no v41jax mapping")
        path, to = mapped
        if path == "head" and cfg.tie_embeddings:
            tied_head = stored  # some tied checkpoints store it too: it must equal the embedding
            continue
        try:
            view = to(stored, cfg)  # a reshape / transpose: a view of the memmap
        except ValueError as e:
            raise ValueError(
                f"{hf_dir}: tensor {name!r} {stored.shape} does not fit the model "
                f"(d_model={cfg.d_model}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
                f"head_dim={cfg.resolved_head_dim}): {e}"
            ) from None
        if path in abstract and view.shape != abstract[path].shape:
            raise ValueError(
                f"{hf_dir}: {path} has shape {view.shape}, the model wants {abstract[path].shape}"
            )
        sources[path] = view
    if tied_head is not None and not np.array_equal(tied_head, sources.get("embed/embedding")):
        raise ValueError(f"{hf_dir}: tie_word_embeddings but lm_head.weight != embed_tokens")
    if missing := sorted(set(abstract) - set(sources)):
        raise ValueError(f"{hf_dir}: no tensor for v41jax params {missing[:6]}")
    if extra := sorted(set(sources) - set(abstract)):
        raise ValueError(f"{hf_dir}: tensors for params the model lacks {extra[:6]}")
    return sources


def _reader(views: list[np.ndarray], stacked: bool, dtype):
    """index (a tuple of slices of the param) -> that slice in `dtype`, read from the memmap
    views: of the one view, or of the layers `index[0]` picks out of a stacked param."""

    def read(index: tuple) -> np.ndarray:
        index = tuple(index)
        if not stacked:
            return np.array(views[0][index], dtype)  # a copy: never a view of the file
        rows = range(len(views))[index[0] if index else slice(None)]
        return np.stack([np.asarray(views[i][index[1:]], dtype) for i in rows])

    return read


def load_hf_params(hf_dir: str, cfg: ModelConfig, shardings: Any = None, dtype=None) -> dict:
    """The params of the HF model in `hf_dir` for `cfg` (`model_config_from_hf` of its
    config, possibly with overrides), in `cfg`'s layer layout; placed into `shardings` (a
    tree like the params, e.g. `make_state_fns(...)[3].params`) when given, else numpy.
    `dtype` casts every tensor (default: cfg.param_dtype). A tensor with no mapping, a
    missing one or one of the wrong shape raises ValueError naming it, before any is read.

    With shardings, each device's slice is read from the memory-mapped files and put on its
    device before the next is read (`_place`): the host holds one slice at a time, never a
    whole parameter or the model; on several hosts each reads only its devices' slices.
    """
    dtype = np.dtype(dtype or cfg.param_dtype)
    abstract = {
        "/".join(k): v for k, v in traverse_util.flatten_dict(_per_layer_abstract(cfg)).items()
    }
    sources = _sources(hf_dir, cfg, abstract)
    # Which per-layer params make each param of cfg's layout: the layout of a tree of ids
    # (a stacked segment's leaf becomes [layers, 1], an unstacked one stays [1]).
    paths = sorted(sources)
    ids = {p: np.array([i]) for i, p in enumerate(paths)}
    layout = convert_layout(traverse_util.unflatten_dict(ids, sep="/"), layer_segments(cfg))
    readers = jax.tree.map(
        lambda a: _reader([sources[paths[i]] for i in a.reshape(-1)], a.ndim == 2, dtype),
        layout,
    )
    shapes = jax.tree.map(
        lambda a: (
            (a.shape[0], *sources[paths[a.reshape(-1)[0]]].shape)
            if a.ndim == 2
            else sources[paths[a[0]]].shape
        ),
        layout,
    )
    if shardings is None:
        return jax.tree.map(
            lambda read, shape: read((slice(None),) * len(shape)), readers, shapes, is_leaf=callable
        )
    return jax.tree.map(_place, readers, shapes, shardings, is_leaf=callable)


def _place(read, shape: tuple[int, ...], sharding) -> jax.Array:
    """The global array of `shape` in `sharding`, built one distinct slice at a time: each
    slice this process's devices hold is read once, put on its devices and dropped, so the
    host holds one slice (not the parameter) at a time."""
    by_slice: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        by_slice.setdefault(key, []).append((device, index))
    arrays = []
    for placed in by_slice.values():
        host = read(placed[0][1])
        arrays.extend(jax.device_put(host, device) for device, _ in placed)
        jax.block_until_ready(arrays[-1])  # the transfer done before the next slice is read
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


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
