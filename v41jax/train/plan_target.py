"""The train step compiled for the real chip, from this CPU: the planner's `--topology` / `--gpu`.

`plan` (v41jax.train.plan) estimates per-device bytes from an XLA:CPU compile. That is an
estimate: XLA:CPU keeps bf16 arithmetic in f32 buffers, fuses differently and runs the
blockwise attention where TPU runs splash. `compile_on_target` compiles the same step
(`make_state_fns` + `make_train_step`, abstract state and batch, nothing allocated) for
compile-only devices of the target (`v41jax.kernels.aot`):

- TPU: `topology="v5e:2x4"` (libtpu's own compiler; Mosaic compiles the Pallas kernels);
- CUDA: `gpu="h100"` / `"h200"` on `1x1x<devices>` (XLA:GPU; Triton compiles the kernels),
  each GPU described by `v41jax/kernels/gpu_targets/<gpu>.txtpb`.

and reads the compiler's own `memory_analysis()` (per device) and `cost_analysis()`. The fit
verdict is peak = arguments + outputs - aliased + temporaries + generated code against the
memory a program may use on the chip (`TARGET_CHIPS`). libtpu's compiler itself refuses a
program whose temporaries exceed it (RESOURCE_EXHAUSTED); that refusal is the verdict then
(`compiler_error`), not an exception. What it cannot say: step time, and whether the
compiled kernels compute the right numbers; a run on the chip does that.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax

from v41jax import sharding
from v41jax.config import Config
from v41jax.kernels import aot
from v41jax.train.plan import abstract_batch
from v41jax.train.state import make_state_fns
from v41jax.train.step import make_train_step


@dataclass(frozen=True)
class Chip:
    """One accelerator: usable memory bytes per device and dense bf16 peak FLOP/s."""

    name: str
    memory: int
    peak_flops: float


_GIB = 1 << 30
# TPU chips by topology generation: the HBM libtpu's compiler says is available to a program
# ("available HBM (15.75G)" when it refuses a larger one; v5e has 16 GiB, 0.25 reserved).
# GPUs by target config name (GPU_TARGETS): the device's whole memory; the driver and the
# CUDA context keep some of it, which a compile without the GPU cannot know.
TARGET_CHIPS = {
    "v4": Chip("TPU v4", int(15.25 * _GIB), 275e12),
    "v5e": Chip("TPU v5e", int(15.75 * _GIB), 197e12),
    "v5p": Chip("TPU v5p", int(95.74 * _GIB), 459e12),
    "v6e": Chip("TPU v6e", int(31.25 * _GIB), 918e12),
    "h100": Chip("H100 SXM 80GB", 80 * _GIB, 989e12),
    "h200": Chip("H200 SXM 141GB", 141 * 10**9, 989e12),
}


def target_chip(platform: str, topology: str | None, gpu: str | None) -> tuple[Chip, str]:
    """(chip, topology text) of a `--topology` (TPU) or `--gpu` (CUDA) choice; ValueError
    naming the value when it does not match `platform` or is unknown."""
    if topology and gpu:
        raise ValueError(f"--topology {topology!r} and --gpu {gpu!r}: give one (TPU or CUDA)")
    if topology:
        if platform != "tpu":
            raise ValueError(f"--topology {topology!r} is a TPU slice; --platform is {platform!r}")
        generation = topology.split(":", 1)[0].lower()
        if ":" not in topology or generation not in aot.TPU_GENERATIONS:
            raise ValueError(
                f"--topology {topology!r}: expected <generation>:<chips> with generation in "
                f"{aot.TPU_GENERATIONS}, e.g. v5e:2x4"
            )
        return TARGET_CHIPS[generation], topology
    if gpu:
        if platform != "cuda":
            raise ValueError(f"--gpu {gpu!r} is a CUDA device; --platform is {platform!r}")
        if gpu.lower() not in aot.GPU_TARGETS:
            raise ValueError(f"--gpu {gpu!r}: known GPU target configs {aot.GPU_TARGETS}")
        return TARGET_CHIPS[gpu.lower()], gpu.lower()
    raise ValueError("target_chip: give --topology (TPU) or --gpu (CUDA)")


def target_devices(topology: str | None, gpu: str | None, n: int):
    """The compile-only devices of the target; their number must be the mesh's `n`."""
    if topology:
        devices = list(aot.tpu_topology(topology).devices)
    else:
        devices = list(aot.cuda_topology(gpu.lower(), f"1x1x{n}").devices)
    if len(devices) != n:
        raise ValueError(
            f"--topology {topology!r} has {len(devices)} chips but the mesh needs {n}: "
            "choose a slice with as many chips as the mesh has devices"
        )
    return devices


def compile_on_target(
    cfg: Config,
    mesh_axes: dict[str, int],
    platform: str,
    topology: str | None = None,
    gpu: str | None = None,
    device_memory: int | None = None,
) -> dict:
    """Compile `cfg`'s train step for the target on `mesh_axes`; the compiler's figures.

    `cfg` is already planned for the mesh (`plan.planned_config`). The chip's HBM is the
    budget unless
    `device_memory` is given. Returns `compile_step_on_devices`'s dict plus the chip.
    """
    chip, where = target_chip(platform, topology, gpu)
    devices = target_devices(topology, gpu, math.prod(mesh_axes.values()))
    budget = chip.memory if device_memory is None else device_memory
    report = compile_step_on_devices(cfg, devices, budget)
    return {
        "platform": platform,
        "target": where,
        "chip": chip.name,
        "peak_flops_per_device": chip.peak_flops,
        **report,
    }


def compile_step_on_devices(
    cfg: Config, devices, device_memory: int, *, keep_text: bool = False
) -> dict:
    """Compile `cfg`'s train step on a mesh (`cfg.mesh`) over compile-only `devices`.

    Returns a JSON-able dict: `memory` (memory_analysis() fields, bytes per device),
    `peak_bytes` and `fits` / `headroom_bytes` against `device_memory`, the compiler's
    FLOPs and bytes accessed per device (cost_analysis(): a while loop's body counted once;
    None where the backend gives none), the custom calls and the Pallas kernels of the
    compiled program (`aot.kernel_ops`: (instruction, op_name) pairs, Mosaic on TPU and
    Triton on CUDA; `pallas_kernels` counts them), and the compile time on this machine.
    A step the compiler refuses for memory has `fits` False, `compiler_error` its message
    and None for the figures it did not produce. `keep_text`: also `text`, the compiled
    module's HLO text (e.g. for `v41jax.kernels.hlo_bytes`; "" for a refused step).
    """
    mesh = sharding.make_mesh(cfg.mesh, devices)
    t0 = time.perf_counter()
    model, optimizer, _, shardings, state = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    batch = abstract_batch(cfg, mesh)
    with jax.set_mesh(mesh), sharding.axis_rules():
        lowered = step.jitted.trace(state, batch).lower()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: over the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        refused = _refused(devices, mesh, device_memory, str(e), time.perf_counter() - t0)
        return ({"text": ""} if keep_text else {}) | refused
    seconds = time.perf_counter() - t0
    memory = aot.compiled_memory(compiled)
    cost = aot.compiled_cost(compiled)
    peak = aot.peak_bytes(memory)
    text = compiled.as_text() or ""
    kernels = aot.kernel_ops(text)
    return ({"text": text} if keep_text else {}) | {
        "device_kind": getattr(devices[0], "device_kind", ""),
        "devices": mesh.devices.size,
        "memory": memory,
        "peak_bytes": peak,
        "device_memory": device_memory,
        "fits": peak <= device_memory,
        "headroom_bytes": device_memory - peak,
        "flops_per_device": cost.get("flops"),
        "bytes_accessed_per_device": cost.get("bytes accessed"),
        "custom_calls": list(aot.custom_call_targets(text)),
        "kernels": [list(k) for k in kernels],
        "pallas_kernels": len(kernels),
        "scoped_vmem_bytes": list(aot.scoped_vmem_bytes(text)),
        "compile_seconds": round(seconds, 1),
        "compiler_error": None,
    }


def _refused(devices, mesh, device_memory: int, error: str, seconds: float) -> dict:
    """The record of a step the compiler refused for the chip's memory: the compiler's
    message (first line) is the verdict; there are no per-device figures."""
    return {
        "device_kind": getattr(devices[0], "device_kind", ""),
        "devices": mesh.devices.size,
        "memory": {},
        "peak_bytes": None,
        "device_memory": device_memory,
        "fits": False,
        "headroom_bytes": None,
        "flops_per_device": None,
        "bytes_accessed_per_device": None,
        "custom_calls": [],
        "kernels": [],
        "pallas_kernels": None,
        "scoped_vmem_bytes": [],
        "compile_seconds": round(seconds, 1),
        "compiler_error": error.strip().splitlines()[0][:400],
    }
