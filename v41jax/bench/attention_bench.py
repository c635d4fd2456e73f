"""Attention implementations: forward+backward time per length, and the compiled temporary
memory of a config's train step against sequence length.

Part 1 times `jax.value_and_grad` of `sum(attend(q, k, v, layout, impl=...))` w.r.t. q, k
and v, jitted, at the config's head shapes (batch 1, causal layout, no segments), for each
implementation at each length; medians of `--iters` calls, best of `--rounds` interleaved
rounds. The `path` column says what each impl runs on this backend (e.g. "dot_product" is
jax.nn's XLA implementation off CUDA, "splash" the Pallas interpreter off TPU).

Part 2 compiles the config's whole train step (`train.step.make_train_step`, batch 1, the
packed-document batch of `train_bench.synthetic_batch`) at each `--step-lengths` T and
reads `compiled.memory_analysis().temp_size_in_bytes`; nothing is run, so T = 16384
costs only a compile. temp(4096) / temp(1024) is ~4 for memory linear in T, ~16 for a
[T, T] score matrix; the other terms of the step (logits [T, V], activations) are linear.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.bench.common import format_table, machine_info, time_call, write_json
from v41jax.bench.train_bench import synthetic_batch
from v41jax.kernels.attention import IMPLS, AttentionLayout, attend, cudnn_limits
from v41jax.sharding import make_mesh
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step

# The device check's run: the default path's memory ratio, short timings.
QUICK = {
    "lengths": "256,1024",
    "splash_max_len": 256,
    "step_lengths": "1024,4096",
    "step_impls": "auto",
    "iters": 3,
    "rounds": 1,
}
MIB = 2**20


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--impls", default=",".join(i for i in IMPLS), help="part 1 impls")
    p.add_argument("--lengths", default="256,1024,4096", help="part 1: comma list of T")
    p.add_argument(
        "--splash-max-len",
        type=int,
        default=1024,
        help="part 1: longest T timed for splash off TPU (it runs in the Pallas interpreter)",
    )
    p.add_argument("--step-impls", default="reference,blockwise,dot_product,auto")
    p.add_argument("--step-lengths", default="1024,4096,16384", help="part 2: comma list of T")
    p.add_argument("--dtype", default="auto", help="part 1 dtype; auto: f32 on CPU, else bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, best median kept")
    p.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    p.add_argument("--json", default=None, help="write results here")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = sorted(set(names) - set(IMPLS))
    if bad:
        raise SystemExit(f"unknown impls {bad}; choose from {IMPLS}")
    return names


def path_of(impl: str, backend: str, q, k, segments: bool) -> str:
    """What `impl` runs for these inputs on `backend` (see kernels/attention/api.py)."""
    on_cuda = backend in ("gpu", "cuda")
    cudnn = on_cuda and cudnn_limits(q, k) is None
    if impl == "auto":
        impl = {"cpu": "blockwise", "tpu": "splash"}.get(backend, "blockwise")
        if cudnn:
            impl = "dot_product"
    if impl in ("reference", "blockwise"):
        return impl
    if impl == "dot_product":
        if segments:
            return "blockwise (dot_product cannot say packed segments)"
        return "cuDNN flash attention" if cudnn else "jax.nn XLA implementation"
    return "splash (compiled)" if backend == "tpu" else "splash (Pallas interpreter)"


def _op_inputs(cfg, t: int, dtype):
    m = cfg.model
    b, h, g, kd = 1, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    rng = np.random.default_rng(t)
    q, k, v = (
        jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
        for shape in ((b, t, h, kd), (b, t, g, kd), (b, t, g, kd))
    )
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return q, k, v, AttentionLayout(pos, pos)


def time_ops(cfg, impls, lengths, dtype, iters, rounds, splash_max_len) -> list[dict]:
    backend = jax.default_backend()
    block = cfg.model.attention_block_size
    jobs = {}
    for t in lengths:
        q, k, v, layout = _op_inputs(cfg, t, dtype)
        for impl in impls:
            if impl == "splash" and backend != "tpu" and t > splash_max_len:
                continue

            def loss(q, k, v, layout=layout, impl=impl):
                out = attend(q, k, v, layout, impl=impl, block_size=block)
                return out.astype(jnp.float32).sum()

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            compile_s = time.perf_counter() - start
            jobs[(impl, t)] = (lambda s=step, a=(q, k, v): s(*a), compile_s, q, k)
    best: dict = {}
    for _ in range(rounds):  # interleaved: every job once per round
        for key, (fn, _, _, _) in jobs.items():
            m = time_call(fn, warmup=1, iters=iters)["median_s"]
            best[key] = min(best.get(key, float("inf")), m)
    rows = []
    for (impl, t), (_, compile_s, q, k) in jobs.items():
        rows.append(
            {
                "impl": impl,
                "path": path_of(impl, backend, q, k, segments=False),
                "T": t,
                "fwd_bwd_ms": 1e3 * best[(impl, t)],
                "first_call_s": compile_s,
                "dtype": jnp.dtype(q.dtype).name,
            }
        )
    return rows


def step_memory(cfg_name, overrides, impl: str, t: int) -> dict:
    """Compiled memory of the train step at batch 1, length t (compiled, never run)."""
    cfg = config_lib.override(
        config_lib.get_config(cfg_name),
        [
            *overrides,
            f"data.seq_len={t}",
            "data.global_batch_size=1",
            f"model.attention_impl={impl}",
        ],
    )
    mesh = make_mesh(cfg.mesh)
    model, optimizer, _, state_shardings, abstract_state = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, state_shardings)
    batch = device_batch(mesh, synthetic_batch(cfg, 0))
    start = time.perf_counter()
    with jax.set_mesh(mesh), sharding.axis_rules():
        compiled = step.jitted.lower(abstract_state, batch).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "compile_s": compile_s,
        "segments": bool(cfg.model.segment_mask),
        "head_dim": cfg.model.resolved_head_dim,
    }


def run(args) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    cfg = config_lib.override(config_lib.get_config(args.config), args.overrides)
    backend = jax.default_backend()
    dtype = (
        (jnp.float32 if backend == "cpu" else jnp.bfloat16)
        if args.dtype == "auto"
        else jnp.dtype(args.dtype)
    )

    op_rows = time_ops(
        cfg,
        _names(args.impls),
        _ints(args.lengths),
        dtype,
        args.iters,
        args.rounds,
        args.splash_max_len,
    )
    m = cfg.model
    print(
        f"forward+backward, B=1, H={m.num_heads}, G={m.num_kv_heads}, K={m.resolved_head_dim}, "
        f"causal, block {m.attention_block_size}"
    )
    print(format_table(op_rows, ["impl", "path", "T", "dtype", "fwd_bwd_ms", "first_call_s"]))

    lengths = _ints(args.step_lengths)
    mem_rows = []
    for impl in _names(args.step_impls):
        row: dict = {"impl": impl}
        for t in lengths:
            m = step_memory(args.config, args.overrides, impl, t)
            row[f"temp_MiB@{t}"] = m["temp_bytes"] / MIB
            row[f"compile_s@{t}"] = m["compile_s"]
            row.setdefault("detail", {})[t] = m
        q, k, _, _ = _op_inputs(cfg, 8, jnp.dtype(cfg.model.compute_dtype))
        row["path"] = path_of(impl, backend, q, k, segments=cfg.model.segment_mask)
        for lo, hi in zip(lengths, lengths[1:], strict=False):
            row[f"ratio_{hi}/{lo}"] = row[f"temp_MiB@{hi}"] / row[f"temp_MiB@{lo}"]
        mem_rows.append(row)
    print(f"\ntrain step `{args.config}` at batch 1: compiled temp memory (MiB) vs T")
    cols = ["impl", "path", *(f"temp_MiB@{t}" for t in lengths)]
    cols += [f"ratio_{hi}/{lo}" for lo, hi in zip(lengths, lengths[1:], strict=False)]
    print(format_table(mem_rows, cols))

    write_json(
        args.json,
        {
            "config": args.config,
            "overrides": args.overrides,
            "op_timing": op_rows,
            "train_step_memory": [{k: v for k, v in r.items()} for r in mem_rows],
            "machine": machine_info(),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
        },
    )
    return 0
