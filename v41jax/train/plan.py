"""Will it fit? The train step compiled ahead of time on fake CPU devices, from abstract shapes.

`plan(cfg, mesh_axes, platform)` builds the abstract train state (`make_state_fns`: shapes
and shardings from `jax.eval_shape`, nothing allocated), the abstract batch, and the real
jitted train step (`make_train_step`), then

- compiles it for the host CPU over `prod(mesh)` devices, whose `memory_analysis()` gives the
  per-device bytes of the arguments (state + batch), outputs (aliased to the donated state),
  and temporaries (activations saved for the backward, gradients, collectives' buffers);
- lowers it for the target platform (`lowering_platforms=("tpu",)` or `("cuda",)`): proof
  that every kernel of that platform lowers, no per-device numbers (compiling for TPU/GPU
  needs the hardware);
- counts FLOPs three ways: XLA's `cost_analysis()` of the CPU program (per device; XLA counts
  a while-loop body once, so scanned layers and blockwise attention are under-counted), the
  matmul FLOPs of the step's jaxpr (`matmul_flops`: every dot_general, scan bodies times their
  length, remat recomputation included; global), and the model FLOPs of
  `v41jax.model.accounting` (6 N_matmul + attention, per token, times the batch's tokens).

Per device: peak = arguments + outputs - aliased + temporaries (the donated state is
rewritten in place). The fit verdict compares it with `device_memory`. CPU numbers are an
estimate for the accelerator: XLA:CPU keeps bf16 arithmetic in f32 buffers and fuses
differently, and the CPU program runs the blockwise XLA attention where TPU runs splash.

MFU bound = model FLOPs / program matmul FLOPs: the fraction of the matmul work the step
executes that counts as model FLOPs (remat recomputation and the chunked loss's second head
pass are not), so the MFU the step can reach if every matmul ran at the chip's peak. The step
time at peak = program matmul FLOPs per device / peak FLOP/s.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from v41jax import sharding
from v41jax.config import Config, override
from v41jax.kernels import aot
from v41jax.model.accounting import model_flops_per_token, param_accounting
from v41jax.train.batches import batch_keys
from v41jax.train.state import make_state_fns
from v41jax.train.step import make_train_step


@dataclass(frozen=True)
class Platform:
    """The device a plan is for: its name, memory (bytes) and dense bf16 peak FLOP/s."""

    device: str
    memory: int
    peak_flops: float


PLATFORMS = {
    "tpu": Platform("TPU v5e", 16 << 30, 197e12),
    "cuda": Platform("H100", 80 << 30, 989e12),
}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """`"16GiB"`, `"80 GB"`, `"512MiB"`, `"1.5e9"` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"--device-memory {text!r}: expected a number with a unit in "
            f"{sorted(u for u in _UNITS if u)} (e.g. 16GiB)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=1,fsdp=8,tensor=1"` -> {"data": 1, "fsdp": 8, "tensor": 1}; missing axes 1."""
    axes = dict.fromkeys(sharding.MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in axes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS in {sharding.MESH_AXES} "
                "and SIZE >= 1 (e.g. data=1,fsdp=8,tensor=1)"
            )
        axes[name] = int(value)
    return axes


def devices_needed(mesh_axes: dict[str, int]) -> int:
    return math.prod(mesh_axes.values())


def check_platform(platform: str) -> Platform:
    if platform not in PLATFORMS:
        raise ValueError(f"--platform {platform!r} not in {sorted(PLATFORMS)}")
    return PLATFORMS[platform]


def planned_config(cfg: Config, mesh_axes: dict[str, int]) -> Config:
    """`cfg` on the given mesh; an unknown Engram compressed vocabulary (filled from the data
    in a real run) set to the vocabulary size, its upper bound (no shape depends on it)."""
    sets = [f"mesh.{a}={n}" for a, n in mesh_axes.items()]
    if cfg.model.engram.enabled and not cfg.model.engram.compressed_vocab_size:
        sets.append(f"model.engram.compressed_vocab_size={cfg.model.vocab_size}")
    cfg = override(cfg, sets)
    shards = mesh_axes["data"] * mesh_axes["fsdp"]
    rows = cfg.data.global_batch_size // cfg.train.microbatches
    if rows % shards:
        raise ValueError(
            f"data.global_batch_size={cfg.data.global_batch_size} / train.microbatches="
            f"{cfg.train.microbatches} = {rows} rows is not divisible by the mesh's data x fsdp "
            f"= {shards} batch shards (--mesh {mesh_axes})"
        )
    return cfg


def abstract_batch(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The train batch as ShapeDtypeStructs split over (data, fsdp): int32 [B, T] tokens,
    positions and segment ids, float32 [B, T] loss mask, int32 [B, T, H] Engram ids."""
    b, t, s = cfg.data.global_batch_size, cfg.data.seq_len, sharding.batch_sharding(mesh)
    heads = cfg.model.engram.num_heads_total
    out = {}
    for key in batch_keys(cfg.model):
        shape, dtype = (b, t), jnp.int32
        if key == "loss_mask":
            dtype = jnp.float32
        elif key.startswith("engram_ids_"):
            shape = (b, t, heads)
        out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    return out


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def matmul_flops(jaxpr) -> tuple[float, int]:
    """(FLOPs of every dot_general in a (closed) jaxpr, while loops seen).

    2 x batch x contracted x lhs-free x rhs-free per dot; a scan's body counts `length`
    times; a cond its most expensive branch; a while loop's body once (its trip count is
    not static: counted, so the caller can say so); any other primitive holding a jaxpr
    (pjit, remat, custom_vjp, shard_map: its body's shapes are per shard, so times the
    devices of the manual axes) its body once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    flops, whiles = 0.0, 0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lc, rc), (lb, _) = params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            batch = math.prod(lhs[d] for d in lb)
            contract = math.prod(lhs[d] for d in lc)
            lfree = math.prod(lhs) // (batch * contract)
            rfree = math.prod(rhs) // (batch * contract)
            flops += 2.0 * batch * contract * lfree * rfree
            continue
        subs = [v for v in params.values() if _is_jaxpr(v)]
        subs += [b for v in params.values() if isinstance(v, tuple) for b in v if _is_jaxpr(b)]
        counted = [matmul_flops(s) for s in subs]
        whiles += sum(w for _, w in counted) + (name == "while")
        body = sum(f for f, _ in counted)
        if name == "cond":
            flops += max((f for f, _ in counted), default=0.0)
        elif name == "scan":
            flops += params["length"] * body
        elif name == "shard_map":
            manual = params.get("manual_axes") or params["mesh"].axis_names
            flops += math.prod(params["mesh"].shape[a] for a in manual) * body
        else:
            flops += body
    return flops, whiles


def _is_jaxpr(v) -> bool:
    return isinstance(v, jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr)


def plan(
    cfg: Config,
    mesh_axes: dict[str, int],
    platform: str = "tpu",
    device_memory: int | None = None,
    peak_flops: float | None = None,
    lower_target: bool = True,
) -> dict:
    """The plan of `cfg`'s train step on `mesh_axes` for `platform` (module docstring).

    Needs prod(mesh) CPU devices in this process (`--xla_force_host_platform_device_count`).
    Returns a JSON-able dict: bytes per device, FLOPs, MFU bound, the fit verdict, the target
    lowering's result; `compiled_memory` holds `memory_analysis()`'s fields as they are.
    """
    target = check_platform(platform)
    cfg = planned_config(cfg, mesh_axes)
    cpus = jax.devices("cpu")
    n = devices_needed(mesh_axes)
    if len(cpus) < n:
        raise ValueError(
            f"--mesh {mesh_axes} needs {n} devices, this process has {len(cpus)} CPU devices "
            f"(set XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts)"
        )
    mesh = sharding.make_mesh(cfg.mesh, cpus[:n])
    t0 = time.perf_counter()
    model, optimizer, _, shardings, state = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    batch = abstract_batch(cfg, mesh)
    with jax.set_mesh(mesh), sharding.axis_rules():
        traced = step.jitted.trace(state, batch)
        compiled = traced.lower().compile()
        compile_s = time.perf_counter() - t0
        lowering = _lower_for(traced, platform) if lower_target else {"skipped": True}
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    program_flops, whiles = matmul_flops(traced.jaxpr)

    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    model_flops = model_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    params_b, opt_b = shard_bytes(state.params), shard_bytes(state.opt_state)
    other_b = shard_bytes((state.step, state.rng))
    batch_b = shard_bytes(batch)
    peak_b = aot.peak_bytes(aot.compiled_memory(compiled))
    budget = device_memory if device_memory is not None else target.memory
    peak = peak_flops or target.peak_flops
    acc = param_accounting(cfg.model, cfg.data.seq_len)
    return {
        "config": cfg.name,
        "mesh": dict(mesh_axes),
        "devices": n,
        "platform": platform,
        "device": target.device,
        "global_batch": [cfg.data.global_batch_size, cfg.data.seq_len],
        "settings": {
            "microbatches": cfg.train.microbatches,
            "remat_policy": cfg.model.remat_policy,
            "logits_chunk": cfg.model.logits_chunk,
            "scan_layers": cfg.model.scan_layers,
            "compute_dtype": cfg.model.compute_dtype,
            "attention_impl": cfg.model.attention_impl,
        },
        "tokens_per_step": tokens,
        "params": acc["total_params"],
        "bytes_source": f"XLA:CPU compile on {n} fake CPU devices (an estimate for {platform})",
        "bytes_per_device": {
            "params": params_b,
            "optimizer_state": opt_b,
            "step_and_rng": other_b,
            "batch": batch_b,
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "generated_code": mem.generated_code_size_in_bytes,
            "peak": peak_b,
        },
        "compiled_memory": {
            k: getattr(mem, k) for k in dir(mem) if k.endswith("_in_bytes") and not k[0] == "_"
        },
        "device_memory": budget,
        "fits": peak_b <= budget,
        "headroom_bytes": budget - peak_b,
        "flops": {
            "xla_cost_analysis_per_device": float(cost.get("flops", 0.0)),
            "program_matmul_global": program_flops,
            "program_matmul_per_device": program_flops / n,
            "program_while_loops": whiles,
            "model_global": model_flops,
            "model_per_device": model_flops / n,
        },
        "peak_flops_per_device": peak,
        "mfu_bound": model_flops / program_flops if program_flops else None,
        "step_seconds_at_peak": program_flops / n / peak,
        "compile_seconds": round(compile_s, 1),
        "target_lowering": lowering,
    }


def _lower_for(traced, platform: str) -> dict:
    """Lower the traced step for `platform`; {"ok", "seconds", "error"}: a failure is data
    (the CPU numbers still stand), its message kept whole."""
    t0 = time.perf_counter()
    try:
        traced.lower(lowering_platforms=(platform,))
    except Exception as e:  # noqa: BLE001 - any lowering error is the finding reported
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 1), "error": repr(e)}
    return {"ok": True, "seconds": round(time.perf_counter() - t0, 1), "error": None}
