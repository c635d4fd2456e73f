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

import math
import os
import struct

import ml_dtypes
import numpy as np

from v41jax.config import parse_json

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
    """(the header's tensor entries, the byte offset of the data) of a safetensors file; a
    file too short for its header, or whose header is not a JSON object, is a ValueError
    naming it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(
                f"{path}: header length {n} exceeds the file ({size} bytes): "
                "cut short, or not a safetensors file"
            )
        header = parse_json(f.read(n), f"{path}: the {n}-byte header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    return header, 8 + n


def _entry(path: str, name: str, entry: object) -> tuple:
    """(numpy dtype, shape, begin, end) of one header entry, every field checked against the
    format and against each other: a header that lies is named here, before any mapping."""
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - set(entry):
        raise ValueError(f"{where}: header entry {entry!r} lacks dtype, shape or data_offsets")
    if entry["dtype"] not in DTYPES:
        raise ValueError(f"{where} has dtype {entry['dtype']!r}, not one of {sorted(DTYPES)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where}: header says shape {shape!r}, not a list of sizes")
    ints = isinstance(offsets, list) and all(type(o) is int for o in offsets)
    if not (ints and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{where}: header says data_offsets {offsets!r}, not [begin, end]")
    dtype, (begin, end) = np.dtype(DTYPES[entry["dtype"]]), offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(
            f"{where}: header says {entry['dtype']}{shape} "
            f"({math.prod(shape) * dtype.itemsize} bytes) at byte range {begin}..{end} "
            f"({end - begin} bytes)"
        )
    return dtype, tuple(shape), begin, end


def mapped_tensors(path: str) -> dict[str, np.ndarray]:
    """{name: read-only memmap of the tensor, with its stored dtype and shape}. Raises
    ValueError naming the file and the tensor whose header entry lies: an unknown dtype, a
    byte range that does not fit its shape, runs past the end of the file (a file cut short:
    the first tensor lost is named) or overlaps another tensor's (a read would return
    another tensor's bytes)."""
    header, start = read_header(path)
    data_bytes = os.path.getsize(path) - start
    entries = {name: _entry(path, name, e) for name, e in header.items()}
    spans = sorted((b, e, name) for name, (_, _, b, e) in entries.items() if e > b)
    if past := [(b, e, name) for b, e, name in spans if e > data_bytes]:
        begin, end, name = past[0]
        lost = f" {len(past)} tensors lie past its end" if len(past) > 1 else ""
        raise ValueError(
            f"{path}: tensor {name}: header says byte range {begin}..{end} of the data, the "
            f"file has {data_bytes} bytes of data after its header (cut short?{lost})"
        )
    for (_, end0, name0), (begin1, end1, name1) in zip(spans, spans[1:], strict=False):
        if begin1 < end0:
            raise ValueError(
                f"{path}: tensor {name1} (byte range {begin1}..{end1}) overlaps tensor "
                f"{name0} (..{end0}): the header's data_offsets lie"
            )
    out = {}
    for name, (dtype, shape, begin, end) in entries.items():
        if begin == end:  # numpy cannot map zero bytes
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype, mode="r", offset=start + begin, shape=shape)
    return out
