"""Compile for a TPU or GPU this machine does not have (ahead of time, nothing executed).

Why: lowering (``.lower(lowering_platforms=("tpu",))``) stops before the backend compilers
run, so it cannot see what Mosaic (TPU Pallas) or Triton (GPU Pallas) reject: misaligned
slices, unsupported loads, VMEM / shared memory over the limit. JAX can run those
compilers on a CPU host against a *described* device:

- TPU: with ``libtpu`` installed (the ``aot`` extra), ``tpu_topology("v5e:2x4")`` describes
  a slice of 8 v5e chips; programs compile for its compile-only devices.
- GPU: with the CUDA PJRT plugin installed (no driver or NVIDIA libraries needed) and
  ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, ``cuda_topology("h100", "1x1x8")`` describes 8
  H100s from a ``GpuTargetConfig`` text proto kept in ``gpu_targets/`` (``GPU_TARGETS``).

``compile_for(fn, args, mesh)`` jits ``fn`` with ``NamedSharding``s on a mesh over such
devices, runs ``.trace(*args).lower().compile()`` and returns the compiled object and a
``CompileRecord``: the compiler's own ``memory_analysis()`` (per device: arguments,
outputs, temporaries, generated code), ``cost_analysis()`` flops / bytes, and the custom
call targets in the compiled program (``tpu_custom_call`` for a Mosaic kernel; a Triton
kernel appears as an ``xla.gpu.triton`` fusion). What this proves: the program
compiles, and its memory fits the described chip. What it cannot: timings and the numerics
of the compiled kernels (a run on the chip does that).

Several processes compiling for TPU at once (test workers) need
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu otherwise takes a lock file for the one process
that owns the (here absent) TPU.

Limit: a mesh over compile-only devices must not be the *current* mesh while tracing code
that evaluates arrays at trace time (``jax.ensure_compile_time_eval``): JAX would try to
execute them there. ``compile_for`` therefore passes shardings on the arguments and does
not enter the mesh unless ``use_mesh=True``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TARGETS_DIR = pathlib.Path(__file__).resolve().parent / "gpu_targets"
GPU_TARGETS = tuple(sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb")))
# TPU generations whose topology names libtpu 0.0.42 knows ("<generation>:<chips>").
TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e")
# The custom call of a Mosaic (Pallas TPU) kernel in a compiled TPU program.
MOSAIC_CUSTOM_CALL = "tpu_custom_call"
# Text of a Triton (Pallas GPU) kernel in a compiled GPU program.
TRITON_MARKER = "xla.gpu.triton"
# CompiledMemoryStats fields kept in a CompileRecord (bytes per device).
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package (jax_plugins) is missing
        return False


def missing_tpu_compiler() -> str:
    """Why TPU programs cannot be compiled here ("" when libtpu is installed)."""
    if not _has_module("libtpu"):
        return "libtpu is not installed (pip install -e '.[aot]', or bash scripts/test_aot.sh)"
    return ""


def missing_cuda_compiler() -> str:
    """Why CUDA programs cannot be compiled here ("" when the CUDA PJRT plugin is there)."""
    if not _has_module("jax_plugins.xla_cuda12"):
        return (
            "the CUDA PJRT plugin (jax-cuda12-plugin) is not installed "
            "(pip install -e '.[aot]', or bash scripts/test_aot.sh)"
        )
    if os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK") != "1":
        return "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 is not set (no CUDA driver on this machine)"
    return ""


def tpu_topology(name: str = "v5e:2x4") -> topologies.TopologyDescription:
    """Compile-only devices of a TPU slice, e.g. ``"v5e:2x4"`` (8 chips) or ``"v5p:2x2x1"``.

    Raises RuntimeError naming the missing piece when libtpu is not installed.
    """
    missing = missing_tpu_compiler()
    if missing:
        raise RuntimeError(f"tpu_topology({name!r}): {missing}")
    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def gpu_target_config(gpu: str) -> str:
    """The ``GpuTargetConfig`` text proto of ``gpu`` (one of ``GPU_TARGETS``, e.g. "h100")."""
    path = TARGETS_DIR / f"{gpu.lower()}.txtpb"
    if not path.is_file():
        raise ValueError(f"no GPU target config {gpu!r}; known: {', '.join(GPU_TARGETS)}")
    return path.read_text()


def cuda_topology(gpu: str = "h100", shape: str = "1x1x8") -> topologies.TopologyDescription:
    """Compile-only devices of ``shape`` (slices x hosts x GPUs per host) ``gpu``s.

    The device is described by ``gpu_targets/<gpu>.txtpb``; needs the CUDA PJRT plugin and
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (RuntimeError naming what is missing otherwise).
    """
    config = gpu_target_config(gpu)
    missing = missing_cuda_compiler()
    if missing:
        raise RuntimeError(f"cuda_topology({gpu!r}, {shape!r}): {missing}")
    return topologies.get_topology_desc(
        topology_name="", platform="cuda", topology=shape, target_config=config
    )


def topology_mesh(
    devices: topologies.TopologyDescription | Sequence[Any],
    shape: Sequence[int] | None = None,
    axis_names: Sequence[str] = ("data",),
) -> Mesh:
    """A ``Mesh`` of ``shape`` (default: all devices on one axis) over compile-only devices."""
    devs = list(getattr(devices, "devices", devices))
    shape = (len(devs),) if shape is None else tuple(shape)
    if len(shape) != len(axis_names) or int(np.prod(shape)) != len(devs):
        raise ValueError(
            f"topology_mesh: shape {shape} with axes {tuple(axis_names)} does not cover "
            f"{len(devs)} devices"
        )
    return Mesh(np.asarray(devs, dtype=object).reshape(shape), tuple(axis_names))


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """What the backend compiler says about one compiled program (figures per device)."""

    platform: str
    device_kind: str
    num_devices: int
    seconds: float
    memory: dict[str, int]  # MEMORY_FIELDS from memory_analysis()
    flops: float | None  # cost_analysis()["flops"]
    bytes_accessed: float | None  # cost_analysis()["bytes accessed"]
    custom_calls: tuple[str, ...]  # custom_call_target names in the compiled program
    has_custom_call: bool | None  # whether ``custom_call`` (if asked) is in the program
    scoped_vmem_bytes: tuple[int, ...]  # TPU: scoped VMEM reserved per Mosaic kernel
    kernels: tuple[tuple[str, str], ...] = ()  # kernel_ops(): (instruction, op_name) each

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CUSTOM_CALL_RE = re.compile(r'custom_call_target="([^"]+)"')
# A compiled TPU program notes in each instruction's backend config the scoped VMEM the
# compiler gave it: "used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"N"}].
_SCOPED_RE = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_SIZE_RE = re.compile(r'"size":"(\d+)"')


def custom_call_targets(text: str) -> tuple[str, ...]:
    """Sorted distinct ``custom_call_target`` names in an HLO text."""
    return tuple(sorted(set(_CUSTOM_CALL_RE.findall(text))))


def scoped_vmem_bytes(text: str) -> tuple[int, ...]:
    """Per Mosaic kernel (``tpu_custom_call`` instruction) of a compiled TPU program, in
    program order: the scoped VMEM bytes the compiler reserved for it (the kernel's
    buffers plus Mosaic's own scratch)."""
    out = []
    for line in text.splitlines():
        if f'custom_call_target="{MOSAIC_CUSTOM_CALL}"' not in line:
            continue
        configs = _SCOPED_RE.findall(line)
        out.append(sum(int(size) for c in configs for size in _SIZE_RE.findall(c)))
    return tuple(out)


_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT )?%([\w.-]+?)(?:\.\d+)? = ")
_OP_NAME_RE = re.compile(r'op_name="([^"]+)"')


def kernel_ops(text: str) -> list[tuple[str, str]]:
    """(instruction name without its ".N" suffix, op_name of its metadata) of every compiled
    Pallas kernel (a Mosaic ``tpu_custom_call`` or a Triton fusion) in a compiled program's
    text, in program order. The op_name is the JAX name stack, e.g.
    ".../ffn_mix._single_pass/shard_map/pallas_call": it says which layer called it;
    a library kernel with a name of its own shows it as the instruction name
    ("splash_mqa_fwd_segmented_residuals")."""
    out = []
    for line in text.splitlines():
        if MOSAIC_CUSTOM_CALL not in line and TRITON_MARKER not in line:
            continue
        name, op = _INSTRUCTION_RE.match(line), _OP_NAME_RE.search(line)
        if name is None or "custom-call(" not in line and "fusion(" not in line:
            continue
        out.append((name.group(1), op.group(1) if op else ""))
    return out


def compiled_memory(compiled) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program as {MEMORY_FIELDS: bytes per device}."""
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return {}
    return {f: int(getattr(stats, f)) for f in MEMORY_FIELDS if hasattr(stats, f)}


def peak_bytes(memory: dict[str, int]) -> int:
    """Peak bytes per device of a compiled program from ``compiled_memory``: arguments +
    outputs - aliased (donated buffers are rewritten in place) + temporaries + code."""
    return (
        memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"]
        + memory["temp_size_in_bytes"]
        + memory["generated_code_size_in_bytes"]
    )


def compiled_cost(compiled) -> dict[str, float]:
    """``cost_analysis()`` of a compiled program as a dict ({} where the backend has none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have none; the record says None
        return {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def _with_sharding(arg, sharding):
    if isinstance(arg, jax.ShapeDtypeStruct) or hasattr(arg, "shape"):
        return jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=sharding)
    return arg


def shaped_args(args: Sequence[Any], mesh: Mesh, in_specs: Sequence[Any] | None = None):
    """``args`` (pytrees of arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying
    ``NamedSharding(mesh, spec)``; ``in_specs`` one PartitionSpec per argument (or per
    leaf, as a matching pytree), replicated where None. Nothing is allocated."""
    specs = [None] * len(args) if in_specs is None else list(in_specs)
    if len(specs) != len(args):
        raise ValueError(f"shaped_args: {len(args)} args but {len(specs)} in_specs")
    out = []
    for arg, spec in zip(args, specs, strict=True):
        if spec is None or isinstance(spec, PartitionSpec):
            sharding = NamedSharding(mesh, spec or PartitionSpec())
            out.append(jax.tree.map(lambda a, s=sharding: _with_sharding(a, s), arg))
        else:
            out.append(
                jax.tree.map(
                    lambda a, s: _with_sharding(a, NamedSharding(mesh, s or PartitionSpec())),
                    arg,
                    spec,
                    is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
                )
            )
    return out


def compile_for(
    fn: Callable[..., Any],
    args: Sequence[Any],
    mesh_or_devices: Mesh | topologies.TopologyDescription | Sequence[Any],
    *,
    in_specs: Sequence[Any] | None = None,
    out_specs: Any = None,
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    custom_call: str | None = None,
    use_mesh: bool = False,
):
    """Compile ``fn(*args)`` for the devices of ``mesh_or_devices``; -> (compiled, record).

    ``args``: arrays or ShapeDtypeStructs (pytrees; only shapes and dtypes are used);
    ``in_specs`` / ``out_specs``: PartitionSpecs over the mesh (replicated when None; a
    device list becomes a 1-D mesh on axis "data"). Static arguments (``static_argnums``)
    are passed through as they are. ``custom_call``: a target name (or text, e.g.
    ``TRITON_MARKER``) whose presence in the compiled program the record reports.
    ``use_mesh``: trace inside the mesh (for code using bare PartitionSpecs; see the
    module docstring for why it is off by default). Compiler errors propagate unchanged.
    """
    mesh = mesh_or_devices if isinstance(mesh_or_devices, Mesh) else topology_mesh(mesh_or_devices)
    static = set(static_argnums)
    dynamic = [a for i, a in enumerate(args) if i not in static]
    dyn_specs = None
    if in_specs is not None:
        dyn_specs = [s for i, s in enumerate(in_specs) if i not in static]
    shaped = iter(shaped_args(dynamic, mesh, dyn_specs))
    call_args = [a if i in static else next(shaped) for i, a in enumerate(args)]
    out_shardings = None
    if out_specs is not None:
        out_shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, s),
            out_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
    jitted = jax.jit(
        fn,
        static_argnums=tuple(static_argnums),
        donate_argnums=tuple(donate_argnums),
        out_shardings=out_shardings,
    )
    start = time.perf_counter()
    if use_mesh:
        with jax.sharding.use_mesh(mesh):
            compiled = jitted.trace(*call_args).lower().compile()
    else:
        compiled = jitted.trace(*call_args).lower().compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text() or ""
    cost = compiled_cost(compiled)
    device = mesh.devices.flat[0]
    record = CompileRecord(
        platform=device.platform,
        device_kind=getattr(device, "device_kind", ""),
        num_devices=mesh.devices.size,
        seconds=round(seconds, 2),
        memory=compiled_memory(compiled),
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        custom_calls=custom_call_targets(text),
        has_custom_call=None if custom_call is None else custom_call in text,
        scoped_vmem_bytes=scoped_vmem_bytes(text),
        kernels=tuple(kernel_ops(text)),
    )
    return compiled, record
