"""mHC's training overhead: the train step of an n = 4 mHC model (forms "reference", "fused",
"single_pass") against the same model with a plain residual, per width d.

Part "cpu" times the jitted train steps on this machine (the XLA path), side by side: every
form's step once per pass, in turn (`time_interleaved`), and reports each form's median step
time and its overhead over plain, the median of the per-pass ratios.

Part "tpu" compiles the same steps for one TPU chip (libtpu's compile-only devices, the
`aot` venv) with the Single-Pass kernels on (`single_pass_impl="pallas"`: the fused forward
and backward kernels) and reads the compiler's `cost_analysis()`: FLOPs and bytes accessed
per step. mHC's added bytes per token per sub-layer (mHC step minus plain step, divided by
tokens x 2 x layers) are compared with the Single-Pass forward's bound (2n + 2) C plus the
backward's (`backward_bound_bytes`), in the streams' dtype. The layers are unscanned there
(`cost_analysis()` counts a while loop's body once).

The models are small (`tiny`'s tokenizer and vocabulary, d_ff = 4d, 2 layers by default,
random token batches): the step's cost does not depend on the token values.
"""

from __future__ import annotations

import argparse
import statistics

import jax

from v41jax import config as config_lib
from v41jax.bench.common import (
    format_table,
    machine_info,
    positive_int,
    time_interleaved,
    write_json,
)
from v41jax.bench.train_bench import synthetic_batch
from v41jax.kernels.mhc_single_pass.backward import backward_bound_bytes
from v41jax.sharding import make_mesh
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step

FORMS = ("plain", "reference", "fused", "single_pass")
N_STREAMS = 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--widths", default="256,1024,2048", help="comma-separated d_model")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=128)
    p.add_argument("--passes", type=positive_int, default=5, help="timed passes over the forms")
    p.add_argument("--parts", default="cpu,tpu", help="cpu (step times), tpu (compiled bytes)")
    p.add_argument("--tpu-topology", default="v5e:2x4", help="TPU slice; one chip of it")
    p.add_argument("--json", default=None, help="write results here")


def form_config(form: str, d: int, args, *, impl: str = "xla", scan: bool = True):
    """The `tiny` model at width d with the given residual form (plain: no mHC)."""
    sets = [
        f"model.d_model={d}",
        f"model.num_heads={max(1, d // 64)}",
        f"model.num_kv_heads={max(1, d // 64)}",
        f"model.d_ff={4 * d}",
        f"model.num_layers={args.layers}",
        f"model.max_seq_len={args.seq}",
        f"model.scan_layers={str(scan).lower()}",
        f"data.seq_len={args.seq}",
        f"data.global_batch_size={args.batch}",
    ]
    if form != "plain":
        sets += [f"model.mhc.n_streams={N_STREAMS}", f"model.mhc.form={form}",
                 f"model.mhc.single_pass_impl={impl}"]  # fmt: skip
    return config_lib.override(config_lib.get_config("tiny"), sets)


def cpu_rows(args, widths) -> list[dict]:
    rows = []
    for d in widths:
        calls = {}
        for form in FORMS:
            cfg = form_config(form, d, args)
            mesh = make_mesh(cfg.mesh)
            model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
            step = make_train_step(cfg, mesh, model, optimizer, shardings)
            batch = device_batch(mesh, synthetic_batch(cfg, 0))
            holder = {"state": init_fn(0)}

            def one(step=step, batch=batch, holder=holder):
                holder["state"], metrics = step(holder["state"], batch)
                return metrics["loss"]

            jax.block_until_ready(one())  # compile
            calls[form] = one
        times = time_interleaved(calls, passes=args.passes)
        plain = times["plain"]
        for form in FORMS:
            ratios = [t / p for t, p in zip(times[form], plain, strict=True)]
            rows.append({
                "d_model": d, "form": form, "step_s": statistics.median(times[form]),
                "overhead": statistics.median(ratios) - 1.0, "passes": args.passes,
            })  # fmt: skip
        print(f"  d={d}: " + ", ".join(f"{r['form']} {r['overhead']:+.1%}" for r in rows[-4:]))
    return rows


def tpu_rows(args, widths) -> list[dict]:
    from v41jax.kernels import aot
    from v41jax.train.plan import planned_config
    from v41jax.train.plan_target import TARGET_CHIPS, compile_step_on_devices

    missing = aot.missing_tpu_compiler()
    if missing:
        print(f"tpu part skipped: {missing}")
        return []
    devices = aot.tpu_topology(args.tpu_topology).devices[:1]
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    chip = TARGET_CHIPS[args.tpu_topology.split(":")[0]]
    rows = []
    for d in widths:
        costs = {}
        for form in ("plain", "single_pass"):
            cfg = planned_config(form_config(form, d, args, impl="pallas", scan=False), one)
            costs[form] = compile_step_on_devices(cfg, devices, chip.memory)
        tokens = args.batch * args.seq
        sublayers = 2 * args.layers
        item = 4  # the streams' dtype: the tiny model computes in float32
        added = costs["single_pass"]["bytes_accessed_per_device"]
        added = (added - costs["plain"]["bytes_accessed_per_device"]) / (tokens * sublayers)
        bound = (2 * N_STREAMS + 2) * d * item + backward_bound_bytes(
            N_STREAMS, d, N_STREAMS * N_STREAMS + 2 * N_STREAMS, item, item, True
        )
        rows.append({
            "d_model": d, "chip": args.tpu_topology,
            "plain_bytes": costs["plain"]["bytes_accessed_per_device"],
            "mhc_bytes": costs["single_pass"]["bytes_accessed_per_device"],
            "plain_flops": costs["plain"]["flops_per_device"],
            "mhc_flops": costs["single_pass"]["flops_per_device"],
            "added_bytes_per_token_sublayer": added, "bound_per_token_sublayer": bound,
            "added_over_bound": added / bound,
            "kernels": costs["single_pass"].get("pallas_kernels"),
        })  # fmt: skip
        print(f"  d={d}: added {added:,.0f} B/token/sub-layer, bound {bound:,} "
              f"({added / bound:.2f}x)")  # fmt: skip
    return rows


def run(args) -> int:
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise SystemExit(
            f"--widths: expected comma-separated integers, got {args.widths!r}"
        ) from None
    if bad := [w for w in widths if w < 64 or w % 64]:
        raise SystemExit(
            f"--widths: each must be a positive multiple of 64 (heads of 64), got {bad}"
        )
    parts = set(args.parts.split(","))
    if bad := parts - {"cpu", "tpu"}:
        raise SystemExit(f"--parts: unknown {sorted(bad)}; choose from cpu, tpu")
    out = {"machine": machine_info(), "n_streams": N_STREAMS, "layers": args.layers,
           "batch": args.batch, "seq": args.seq}  # fmt: skip
    if "cpu" in parts:
        out["cpu"] = cpu_rows(args, widths)
        print(format_table(out["cpu"], ["d_model", "form", "step_s", "overhead"]))
    if "tpu" in parts:
        out["tpu"] = tpu_rows(args, widths)
        if out["tpu"]:
            cols = ["d_model", "plain_bytes", "mhc_bytes", "added_bytes_per_token_sublayer",
                    "bound_per_token_sublayer", "added_over_bound"]  # fmt: skip
            print(format_table(out["tpu"], cols))
    write_json(args.json, out)
    return 0
