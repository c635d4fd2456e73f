"""`load_hf_params` into shardings reads each device's slice from the memory-mapped files:
the params equal the eager (numpy) load, and the host's peak allocation while loading is a
fraction of the model, where the eager load's is the whole model (the control)."""

import functools
import json
import os
import tracemalloc

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import Mesh

from v41jax.config import ModelConfig
from v41jax.hf import load_hf_params, save_hf
from v41jax.hf.mapped import mapped_tensors
from v41jax.model import init_params
from v41jax.sharding import tree_shardings

CFG = ModelConfig(
    vocab_size=512, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=768,
    max_seq_len=64, tie_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("llama"))
    params = nn.unbox(init_params(CFG, jax.random.key(3)))
    files = save_hf(params, CFG, "llama", out, max_shard_bytes=4 << 20)
    assert len(files) > 3  # several files and an index
    return out, jax.device_get(params)


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_each_device_reads_its_slice_only(hf_dir):
    path, want = hf_dir
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "the suite runs on 8 fake CPU devices"
    mesh = Mesh(devices.reshape(1, 8, 1), ("data", "fsdp", "tensor"))
    abstract = jax.eval_shape(functools.partial(init_params, CFG), jax.random.key(0))
    shardings = tree_shardings(mesh, abstract)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(want))

    eager, eager_peak = _peak(lambda: load_hf_params(path, CFG))
    sharded, sharded_peak = _peak(lambda: load_hf_params(path, CFG, shardings))
    jax.tree.map(np.testing.assert_array_equal, eager, want)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), sharded, want)
    for leaf, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == s
    # every param is split 8 ways over fsdp
    assert {len(s.device_set) for s in jax.tree.leaves(shardings)} == {8}
    assert eager_peak >= model_bytes  # the control: tracemalloc sees numpy's copies
    biggest = max(x.nbytes for x in jax.tree.leaves(want))
    # one slice at a time (a stacked FFN weight is 3 MiB, its slice 0.4 MiB)
    assert sharded_peak < biggest / 2 < model_bytes / 8, (sharded_peak, biggest, model_bytes)


def test_bad_files_are_refused_by_name(hf_dir, tmp_path):
    path, _ = hf_dir
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    bad = tmp_path / "bad.safetensors"
    raw = open(os.path.join(path, files[0]), "rb").read()
    (n,) = np.frombuffer(raw[:8], "<u8")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F4"
    text = json.dumps(header).encode()
    bad.write_bytes(np.uint64(len(text)).tobytes() + text + raw[8 + n :])
    with pytest.raises(ValueError, match=f"{name}.*dtype 'F4'"):
        mapped_tensors(str(bad))
    header[name]["dtype"], header[name]["data_offsets"][1] = "F32", 10**12
    text = json.dumps(header).encode()
    bad.write_bytes(np.uint64(len(text)).tobytes() + text + raw[8 + n :])
    with pytest.raises(ValueError, match=f"{name}.*byte range"):
        mapped_tensors(str(bad))
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        mapped_tensors(str(bad))
