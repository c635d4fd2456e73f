"""Tensors of a safetensors file as read-only memory maps: reading a slice reads only it.

Why not `safetensors.safe_open`: its `get_tensor` copies a tensor whole, and `get_slice`
slices only the stored layout, while a v41jax param is a reshaped / transposed view of the
stored tensor (`v41jax.hf.convert`) cut into the shards of a mesh. A `numpy.memmap` of the
tensor's bytes takes those views for free, so `view[shard_index]` copies one device's slice
and nothing else; the pages it touches belong to the file (the page cache), not to the
process. The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}, then the data, offsets counted from its start.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def read_header(path: str) -> tuple[dict, int]:
    """(the header's tensor entries, the byte offset of the data) of a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def mapped_tensors(path: str) -> dict[str, np.ndarray]:
    """{name: read-only memmap of the tensor, with its stored dtype and shape}. Raises
    ValueError naming a tensor of an unknown dtype or whose byte range does not fit."""
    header, start = read_header(path)
    size = os.path.getsize(path)
    out = {}
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, not one of "
                             f"{sorted(DTYPES)}")  # fmt: skip
        dtype, shape = np.dtype(DTYPES[entry["dtype"]]), tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise ValueError(
                f"{path}: tensor {name!r} {entry['dtype']}{list(shape)} has byte range "
                f"[{begin}, {end}), which does not fit its shape or the file ({size} bytes)"
            )
        if begin == end:  # numpy cannot map zero bytes
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype, mode="r", offset=start + begin, shape=shape)
    return out
