"""The TPU and CUDA compilers run on this CPU box: a sharded matmul compiles for each."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from v41jax.kernels import aot

ARGS = [
    jax.ShapeDtypeStruct((1024, 512), jnp.float32),
    jax.ShapeDtypeStruct((512, 256), jnp.float32),
]
# Per device: the row block of a (1024/8 rows) and all of b.
ARG_BYTES = (1024 // 8) * 512 * 4 + 512 * 256 * 4


def _matmul(a, b):
    return a @ b


def _check(record, platform: str):
    assert record.platform == platform and record.num_devices == 8
    assert record.memory, "memory_analysis() is empty"
    assert record.memory["argument_size_in_bytes"] == ARG_BYTES
    assert record.memory["output_size_in_bytes"] == (1024 // 8) * 256 * 4


def test_matmul_compiles_for_tpu_v5e(tpu_v5e):
    compiled, record = aot.compile_for(_matmul, ARGS, tpu_v5e, in_specs=[P("data"), None])
    _check(record, "tpu")
    assert record.device_kind.startswith("TPU v5")
    assert record.flops == 2 * (1024 // 8) * 512 * 256  # the TPU compiler's own count


def test_matmul_compiles_for_h100(cuda_h100):
    compiled, record = aot.compile_for(_matmul, ARGS, cuda_h100, in_specs=[P("data"), None])
    _check(record, "gpu")
    assert record.device_kind == "NVIDIA H100 80GB HBM3"  # from gpu_targets/h100.txtpb


def test_every_gpu_target_parses(cuda_h100):
    for gpu in aot.GPU_TARGETS:
        devices = aot.cuda_topology(gpu, "1x1x1").devices
        assert len(devices) == 1 and devices[0].device_kind.startswith("NVIDIA H")


def test_unknown_gpu_target_is_named():
    import pytest

    with pytest.raises(ValueError, match="no GPU target config 'a100'; known: h100, h200"):
        aot.gpu_target_config("a100")
