"""`python -m v41jax plan`: the memory planner's command line and its table (v41jax.train.plan).

    python -m v41jax plan --config 1b --mesh data=1,fsdp=8,tensor=1 --platform tpu
    python -m v41jax plan --config 8b --mesh data=1,fsdp=8,tensor=1 --platform cuda \
        --json experiments/plan/8b_cuda.json

The plan compiles on prod(mesh) fake CPU devices, which XLA creates only if told before jax
starts: a process that has already started jax with fewer CPU devices runs the same command
again in a subprocess with `--xla_force_host_platform_device_count` set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_plan_parser(sub) -> None:
    """Register the `plan` subcommand on `sub` (argparse subparsers)."""
    from v41jax import config as config_lib

    p = sub.add_parser(
        "plan", help="will it fit? per-device bytes, FLOPs and MFU bound of the train step"
    )
    p.add_argument("--config", required=True, help=f"named config {config_lib.named_configs()}")
    p.add_argument("--mesh", required=True, help="e.g. data=1,fsdp=8,tensor=1 (missing axes: 1)")
    p.add_argument("--platform", default="tpu", help="tpu (TPU v5e) or cuda (H100)")
    p.add_argument(
        "--device-memory", help="bytes per device, e.g. 16GiB (default: the platform's device)"
    )
    p.add_argument("--peak-flops", type=float, help="per device (default: the platform's)")
    p.add_argument("--no-lower", action="store_true", help="skip lowering for --platform")
    p.add_argument(
        "--topology",
        help="also compile for this TPU slice, e.g. v5e:2x4 (needs libtpu: the aot extra)",
    )
    p.add_argument(
        "--gpu", help="also compile for this many GPUs, e.g. h100, h200 (needs the aot extra)"
    )
    p.add_argument("--json", help="also write the plan as JSON here")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set model.remat_policy=full (repeatable)",
    )
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    """Plan in this process when it has the CPU devices the mesh needs, else in a child."""
    from v41jax.train.plan import check_platform, devices_needed, parse_bytes, parse_mesh

    mesh_axes = parse_mesh(args.mesh)  # bad input is an error before any subprocess
    check_platform(args.platform)
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    n = devices_needed(mesh_axes)
    chip = None
    if args.topology or args.gpu:  # before the CPU compile: a bad target fails in a second
        chip = _check_target(args)
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():  # XLA reads the flag when jax starts
        os.environ["XLA_FLAGS"] = _with_device_count(os.environ.get("XLA_FLAGS", ""), n)
        import jax

        jax.config.update("jax_platforms", "cpu")  # an accelerator here is not needed
    else:
        import jax

        if len(jax.devices("cpu")) < n:  # started with too few: the same command, anew
            env = dict(os.environ, XLA_FLAGS=_with_device_count(os.environ.get("XLA_FLAGS", ""), n))
            env["JAX_PLATFORMS"] = "cpu"
            cmd = [sys.executable, "-m", "v41jax.train.plan_cli", *_argv(args)]
            return subprocess.run(cmd, env=env, check=False).returncode
    from v41jax import config as config_lib
    from v41jax.train.plan import plan

    cfg = config_lib.override(config_lib.get_config(args.config), args.overrides)
    if chip is not None:  # the CPU estimate is judged against the same chip
        memory = memory if memory is not None else chip.memory
        peak_flops = args.peak_flops or chip.peak_flops
    else:
        peak_flops = args.peak_flops
    report = plan(cfg, mesh_axes, args.platform, memory, peak_flops, lower_target=not args.no_lower)
    if chip is not None:
        from v41jax.train.plan import planned_config
        from v41jax.train.plan_target import compile_on_target

        report["device"] = chip.name
        report["target_compile"] = compile_on_target(
            planned_config(cfg, mesh_axes),
            mesh_axes,
            args.platform,
            topology=args.topology,
            gpu=args.gpu,
            device_memory=memory,
        )
    report["command"] = "python -m v41jax " + " ".join(_argv(args, for_record=True))
    print(format_plan(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def _check_target(args):
    """The chip of --topology / --gpu, its compiler present (ValueError naming what is not)."""
    if args.gpu:  # no CUDA driver here: the plugin compiles for the described GPU only
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    # libtpu's lock file claims the (here absent) TPU for one process; compiling needs none
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from v41jax.kernels import aot
    from v41jax.train.plan_target import target_chip

    chip, _ = target_chip(args.platform, args.topology, args.gpu)
    missing = aot.missing_tpu_compiler() if args.topology else aot.missing_cuda_compiler()
    if missing:
        raise ValueError(f"--{'topology' if args.topology else 'gpu'}: {missing}")
    return chip


def _with_device_count(flags: str, n: int) -> str:
    """XLA_FLAGS with the fake CPU device count set to n (replacing any earlier value)."""
    flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\d+", "", flags).strip()
    return f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


def _argv(args, for_record: bool = False) -> list[str]:
    """The `plan` command line of `args` (to rerun it in a subprocess, or to record it)."""
    out = ["plan", "--config", args.config, "--mesh", args.mesh, "--platform", args.platform]
    if args.device_memory:
        out += ["--device-memory", args.device_memory]
    if args.peak_flops:
        out += ["--peak-flops", str(args.peak_flops)]
    if args.no_lower:
        out.append("--no-lower")
    if args.topology:
        out += ["--topology", args.topology]
    if args.gpu:
        out += ["--gpu", args.gpu]
    if args.json and not for_record:
        out += ["--json", args.json]
    for s in args.overrides:
        out += ["--set", s]
    return out


def _gib(n: float) -> str:
    """Bytes in GiB (MiB under 1 GiB, so a batch of a few MiB does not read 0.000 GiB)."""
    if abs(n) < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.3f} GiB"


def format_plan(r: dict) -> str:
    """The plan as a text table (markdown), every number per device unless it says so; with
    a target compile (--topology / --gpu) a third column holds the target compiler's own
    figures beside the CPU estimate."""
    b, f = r["bytes_per_device"], r["flops"]
    t = r.get("target_compile")
    tm = t["memory"] if t else {}
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    batch, seq = r["global_batch"]
    xla_flops, step_s = f["xla_cost_analysis_per_device"], f"{r['step_seconds_at_peak']:.3f} s"

    def target(key):
        return _gib(tm[key]) if key in tm else ""

    def verdict(fits, headroom):
        if headroom is None:  # the compiler refused the step for memory
            return "NO (the compiler refused it: " + t["compiler_error"][:160] + ")"
        return f"{'yes' if fits else 'NO'} (headroom {_gib(headroom)})"

    rows = [
        ("parameters", _gib(b["params"]), ""),
        ("optimizer state", _gib(b["optimizer_state"]), ""),
        ("batch (+ step, rng)", _gib(b["batch"] + b["step_and_rng"]), ""),
        ("arguments (compiled)", _gib(b["arguments"]), target("argument_size_in_bytes")),
        (
            "outputs (compiled; aliased to the donated state)",
            _gib(b["outputs"]),
            target("output_size_in_bytes"),
        ),
        ("aliased (compiled)", _gib(b["aliased"]), target("alias_size_in_bytes")),
        (
            "activations + temporaries (compiled)",
            _gib(b["temporaries"]),
            target("temp_size_in_bytes"),
        ),
        (
            "generated code (compiled)",
            _gib(b["generated_code"]),
            target("generated_code_size_in_bytes"),
        ),
        (
            "peak = arguments + outputs - aliased + temporaries + code",
            _gib(b["peak"]),
            _gib(t["peak_bytes"]) if t and t["peak_bytes"] is not None else "",
        ),
        (
            f"device memory ({r['device']})",
            _gib(r["device_memory"]),
            _gib(t["device_memory"]) if t else "",
        ),
        (
            "fits",
            verdict(r["fits"], r["headroom_bytes"]),
            verdict(t["fits"], t["headroom_bytes"]) if t else "",
        ),
        ("FLOPs/step, model (6 N + attention), global", f"{f['model_global']:.4g}", ""),
        ("FLOPs/step, program matmuls (jaxpr), global", f"{f['program_matmul_global']:.4g}", ""),
        (
            "FLOPs/step, XLA cost analysis, per device (loops once)",
            f"{xla_flops:.4g}",
            f"{t['flops_per_device']:.4g}" if t and t["flops_per_device"] else "",
        ),
        ("MFU bound (model / program matmul FLOPs)", _pct(r["mfu_bound"]), ""),
        (f"step time at peak ({r['peak_flops_per_device']:.4g} FLOP/s)", step_s, ""),
        (f"lowers for {r['platform']}", _lowering(r["target_lowering"]), ""),
    ]
    if t:
        kind = "Mosaic" if t["platform"] == "tpu" else "Triton"
        count = "-" if t["pallas_kernels"] is None else f"{t['pallas_kernels']} {kind}"
        rows.append(("Pallas kernels in the compiled program", "", count))
    width = max(len(k) for k, *_ in rows)
    head = (
        f"plan: {r['config']} ({_count(r['params'])} params), mesh {mesh} on {r['devices']} "
        f"x {r['device']}, batch {batch} x {seq} tokens\n"
        f"settings: {', '.join(f'{k}={v}' for k, v in r['settings'].items())}\n"
        f"bytes per device from the {r['bytes_source']}; compiled in {r['compile_seconds']} s\n"
    )
    if not t:
        lines = [f"| {'per device':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:<{width}} | {v} |" for k, v, _ in rows]
        return head + "\n".join(lines)
    col = f"compiled for {t['devices']} x {t['chip']} ({t['target']})"
    head += f"target column: the {t['platform']} compiler's own figures; compiled in "
    head += f"{t['compile_seconds']} s\n"
    lines = [
        f"| {'per device':<{width}} | CPU estimate | {col} |",
        f"|{'-' * (width + 2)}|---|---|",
    ]
    lines += [f"| {k:<{width}} | {v} | {tv} |" for k, v, tv in rows]
    return head + "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _lowering(low: dict) -> str:
    if low.get("skipped"):
        return "not tried (--no-lower)"
    if low["ok"]:
        return f"yes ({low['seconds']} s)"
    return f"NO: {low['error'][:300]}"


def main(argv: list[str] | None = None) -> int:
    """`python -m v41jax.train.plan_cli ...`: the same command without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="python -m v41jax")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
