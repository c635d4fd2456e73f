"""mHC's training overhead: the train step of an n = 4 mHC model (forms "reference", "fused",
"single_pass") against the same model with a plain residual, per width d.

Part "cpu" times the jitted train steps on this machine (the XLA path), side by side: every
form's step once per pass, in turn (`time_interleaved`), and reports each form's median step
time and its overhead over plain, the median of the per-pass ratios.

Part "tpu" compiles the same steps for one TPU chip (libtpu's compile-only devices, the
`aot` venv) with the Single-Pass kernels on (`single_pass_impl="pallas"`: the fused forward
and backward kernels), at `--tpu-batch` x `--tpu-seq` tokens (8 x 512 by default: with few
tokens the step's bytes are the weights', and the compiler's weight-prefetch choices, which
shift with anything else in the program, swamp mHC's), at `--tpu-layers` L and 2L layers,
and reads the compiler's `cost_analysis()`: FLOPs and bytes accessed per step. mHC's added
bytes per token per sub-layer (mHC step minus plain step, divided by tokens x 2 x layers)
are given for the whole step at L and as the marginal of one more layer (the difference
between 2L and L: what each sub-layer of a deep model adds, without the once-per-model
expansion into n streams, first statistics and collapse), and compared with the
Single-Pass forward's bound (2n + 2) C plus the backward's (`backward_bound_bytes`), in the
streams' dtype. The marginal is split by `v41jax.kernels.hlo_bytes` into the mHC kernels,
mHC's XLA code, the sub-layers, other model code and the compiler's own copies. The layers
are unscanned there (`cost_analysis()` counts a while loop's body once).

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
    p.add_argument(
        "--tpu-layers",
        type=positive_int,
        default=2,
        help="tpu part: compile at this many layers and twice as many",
    )
    p.add_argument("--tpu-batch", type=positive_int, default=8, help="tpu part: sequences")
    p.add_argument("--tpu-seq", type=positive_int, default=512, help="tpu part: their length")
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


def width_row(d: int, costs: dict, parts: dict, layers: tuple[int, int], tokens: int) -> dict:
    """One width's row from the compiled steps: `costs[form, layers]` (compile_step_on_devices)
    and `parts[form, layers]` (hlo_bytes.bytes_by_part), forms "plain" and "single_pass"."""
    from v41jax.kernels.hlo_bytes import PARTS

    lo, hi = layers
    total = lambda f, n: costs[f, n]["bytes_accessed_per_device"]
    added = lambda n: total("single_pass", n) - total("plain", n)
    part_added = lambda n, p: parts["single_pass", n][p] - parts["plain", n][p]
    per_sublayer = lambda b, n: b / (tokens * 2 * n)
    whole = per_sublayer(added(lo), lo)
    marginal = per_sublayer(added(hi) - added(lo), hi - lo)
    item = 4  # the streams' dtype: the tiny model computes in float32
    k = N_STREAMS * N_STREAMS + 2 * N_STREAMS
    bound = (2 * N_STREAMS + 2) * d * item + backward_bound_bytes(N_STREAMS, d, k, item, item, True)
    parsed = sum(sum(v.values()) for v in parts.values())
    return {
        "d_model": d, "tokens": tokens, "layers": [lo, hi],
        "plain_bytes": [total("plain", lo), total("plain", hi)],
        "mhc_bytes": [total("single_pass", lo), total("single_pass", hi)],
        "plain_flops": costs["plain", lo]["flops_per_device"],
        "mhc_flops": costs["single_pass", lo]["flops_per_device"],
        "added_bytes_per_token_sublayer": whole,
        "marginal_bytes_per_token_sublayer": marginal,
        "bound_per_token_sublayer": bound,
        "added_over_bound": whole / bound, "marginal_over_bound": marginal / bound,
        "marginal_by_part": {
            p: per_sublayer(part_added(hi, p) - part_added(lo, p), hi - lo) for p in PARTS
        },
        "parse_over_cost": parsed / sum(total(*key) for key in costs),
        "kernels": costs["single_pass", lo].get("pallas_kernels"),
    }  # fmt: skip


def tpu_rows(args, widths) -> list[dict]:
    """Per width: the steps of plain and single-pass mHC compiled at `--tpu-layers` L and 2L
    layers. mHC's added bytes per token per sub-layer: of the whole step at L (it includes
    the once-per-model work: the n-stream expansion of the embedding, the first sub-layer's
    statistics in XLA, the collapse before the head, and the relayouts between them and the
    kernels), and the marginal of one more layer, (added at 2L - added at L) / (tokens 2 L):
    what every sub-layer of a deep model costs. The marginal is split into the parts of
    `hlo_bytes.part_of` (from the compiled text; their sum tracks the compiler's total to
    about 10%, `parse_over_cost` is the ratio)."""
    from v41jax.kernels import aot, hlo_bytes
    from v41jax.train.plan import planned_config
    from v41jax.train.plan_target import TARGET_CHIPS, compile_step_on_devices

    missing = aot.missing_tpu_compiler()
    if missing:
        print(f"tpu part skipped: {missing}")
        return []
    devices = aot.tpu_topology(args.tpu_topology).devices[:1]
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    chip = TARGET_CHIPS[args.tpu_topology.split(":")[0]]
    shape = argparse.Namespace(batch=args.tpu_batch, seq=args.tpu_seq)
    tokens = args.tpu_batch * args.tpu_seq
    rows = []
    for d in widths:
        costs, parts = {}, {}
        for layers in (args.tpu_layers, 2 * args.tpu_layers):
            for form in ("plain", "single_pass"):
                cfg_args = argparse.Namespace(**vars(shape), layers=layers)
                cfg = form_config(form, d, cfg_args, impl="pallas", scan=False)
                cost = compile_step_on_devices(planned_config(cfg, one), devices, chip.memory,
                                               keep_text=True)  # fmt: skip
                text = cost.pop("text")
                costs[form, layers] = cost
                parts[form, layers] = hlo_bytes.bytes_by_part(text)
        row = width_row(d, costs, parts, (args.tpu_layers, 2 * args.tpu_layers), tokens)
        rows.append({"chip": args.tpu_topology, **row})
        whole, marginal = (row[f"{k}_bytes_per_token_sublayer"] for k in ("added", "marginal"))
        print(f"  d={d}: added {whole:,.0f} B/token/sub-layer at {args.tpu_layers} layers, "
              f"marginal {marginal:,.0f} = {row['marginal_over_bound']:.2f}x the bound "
              f"{row['bound_per_token_sublayer']:,}; marginal by part: "
              + ", ".join(f"{p} {v:,.0f}" for p, v in row["marginal_by_part"].items()))  # fmt: skip
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
            cols = ["d_model", "added_bytes_per_token_sublayer",
                    "marginal_bytes_per_token_sublayer", "bound_per_token_sublayer",
                    "marginal_over_bound"]  # fmt: skip
            print(format_table(out["tpu"], cols))
    write_json(args.json, out)
    return 0
