"""The whole train step, prefill and decode compiled (not only lowered) for TPU and H100s.

The model is the lowering test's (tests/train/test_lowering_steps.py): Engram, mHC single
pass and MoE, every kernel impl "auto", tiny widths. The train step compiles as the planner
compiles it (`plan_target.compile_step_on_devices`: abstract state and batch, the mesh set
while tracing):

- on 8 chips (v5e:2x4; 8 H100s, 8 H200s) with FSDP over all of them: splash attention and the mHC
  kernel run per device inside their shard_maps (a Mosaic kernel cannot be partitioned by
  GSPMD: the mHC kernel once reached it unwrapped and the compiler refused the step). The
  Engram tables' rows are split over the devices there, so the lookup is the all-to-all
  exchange (XLA), not the kernel;
- on one chip, where the Engram lookup is the kernel too.

Prefill and decode (plain jits, as the speculative engine and `generate` call them) compile
on one chip. Asserted: which kernels are in the compiled program (by the JAX name stack of
each Mosaic / Triton call, `aot.kernel_ops`), that the program fits the chip, and on TPU that
every kernel's scoped VMEM is within the chip's.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from v41jax import config as config_lib
from v41jax.decode import DecodeState, decode_step, init_cache, prefill
from v41jax.kernels import aot
from v41jax.sharding import make_mesh
from v41jax.train.plan import planned_config
from v41jax.train.plan_target import TARGET_CHIPS, compile_step_on_devices
from v41jax.train.state import make_state_fns

_LOWERING = pathlib.Path(__file__).parents[1] / "train" / "test_lowering_steps.py"
_spec = importlib.util.spec_from_file_location("lowering_steps", _LOWERING)
lowering_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lowering_steps)

V5E_VMEM = 128 << 20  # bytes of VMEM per v5e core
FSDP8 = {"data": 1, "fsdp": 8, "tensor": 1}
ONE = {"data": 1, "fsdp": 1, "tensor": 1}


def _cfg(axes):
    cfg = config_lib.override(
        config_lib.get_config("tiny"), [*lowering_steps.MODEL, "data.global_batch_size=8"]
    )
    return planned_config(cfg, axes)


def _kernels(report) -> dict[str, int]:
    """{"attention" | "mhc_single_pass" | "engram_lookup" | other name: count}."""
    out: dict[str, int] = {}
    for name, op in report["kernels"]:
        if name.startswith("splash_mqa"):
            key = "attention"
        elif "_single_pass/" in op:
            key = "mhc_single_pass"
        elif "engram" in op.lower():
            key = "engram_lookup"
        else:
            key = name
        out[key] = out.get(key, 0) + 1
    return out


def _check(report, chip: str):
    assert report["fits"], report["peak_bytes"]
    assert report["device_memory"] == TARGET_CHIPS[chip].memory
    assert all(0 <= v <= V5E_VMEM for v in report["scoped_vmem_bytes"]), report["scoped_vmem_bytes"]


def test_train_step_compiles_for_a_v5e_slice(tpu_v5e):
    report = compile_step_on_devices(_cfg(FSDP8), tpu_v5e.devices, TARGET_CHIPS["v5e"].memory)
    _check(report, "v5e")
    kernels = _kernels(report)
    # forward, dq and dkv of splash per attention call; the mHC pass in every layer's mixes
    assert kernels.get("attention", 0) >= 3 and kernels.get("mhc_single_pass", 0) >= 2, kernels
    assert set(kernels) <= {"attention", "mhc_single_pass"}, kernels


def test_train_step_compiles_on_one_v5e_chip_with_the_engram_kernel(tpu_v5e):
    report = compile_step_on_devices(_cfg(ONE), tpu_v5e.devices[:1], TARGET_CHIPS["v5e"].memory)
    _check(report, "v5e")
    kernels = _kernels(report)
    assert {"attention", "mhc_single_pass", "engram_lookup"} <= set(kernels), kernels


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_train_step_compiles_for_eight_gpus(cuda_h100, gpu):
    devices = cuda_h100.devices if gpu == "h100" else aot.cuda_topology(gpu, "1x1x8").devices
    report = compile_step_on_devices(_cfg(FSDP8), devices, TARGET_CHIPS[gpu].memory)
    assert gpu.upper() in report["device_kind"]
    _check(report, gpu)
    # training batches carry segment ids, which cuDNN cannot say: attention is blockwise XLA
    assert _kernels(report).get("mhc_single_pass", 0) >= 2, report["kernels"]


def _decode_args(cfg, batch_size=2, prompt_len=8):
    m = cfg.model
    abstract = make_state_fns(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))[4]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract.params)
    window = jnp.zeros((batch_size, m.engram.max_ngram_size), jnp.int32)
    state = jax.eval_shape(lambda: DecodeState(init_cache(m, batch_size), window))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return params, state, i32(batch_size), i32(batch_size, prompt_len), i32(m.vocab_size)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_prefill_and_decode_compile_on_one_chip(platform, which, request):
    devices = request.getfixturevalue("tpu_v5e" if platform == "tpu" else "cuda_h100").devices
    cfg = _cfg(ONE)
    params, state, tokens_b, prompt_bxp, compression = _decode_args(cfg)
    if which == "prefill":
        fn = lambda p, x, n, c: prefill(p, cfg.model, x, n, c)  # noqa: E731
        args = (params, prompt_bxp, tokens_b, compression)
    else:
        fn = lambda p, x, s, pos, c: decode_step(p, cfg.model, x, s, pos, c)  # noqa: E731
        args = (params, tokens_b, state, tokens_b, compression)
    _, record = aot.compile_for(fn, args, devices[:1])
    kinds = set(_kernels({"kernels": record.kernels}))
    # the KV-cache layouts take the blockwise attention on every platform
    assert {"mhc_single_pass", "engram_lookup"} <= kinds, record.kernels
    assert record.memory["temp_size_in_bytes"] < TARGET_CHIPS["v5e"].memory
