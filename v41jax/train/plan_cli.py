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
    report = plan(
        cfg, mesh_axes, args.platform, memory, args.peak_flops, lower_target=not args.no_lower
    )
    report["command"] = "python -m v41jax " + " ".join(_argv(args, for_record=True))
    print(format_plan(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


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
    """The plan as a text table (markdown), every number per device unless it says so."""
    b, f = r["bytes_per_device"], r["flops"]
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    batch, seq = r["global_batch"]
    xla_flops, step_s = f["xla_cost_analysis_per_device"], f"{r['step_seconds_at_peak']:.3f} s"
    rows = [
        ("parameters", _gib(b["params"])),
        ("optimizer state", _gib(b["optimizer_state"])),
        ("batch (+ step, rng)", _gib(b["batch"] + b["step_and_rng"])),
        ("arguments (compiled)", _gib(b["arguments"])),
        ("outputs (compiled; aliased to the donated state)", _gib(b["outputs"])),
        ("aliased (compiled)", _gib(b["aliased"])),
        ("activations + temporaries (compiled)", _gib(b["temporaries"])),
        ("peak = arguments + outputs - aliased + temporaries", _gib(b["peak"])),
        (f"device memory ({r['device']})", _gib(r["device_memory"])),
        ("fits", f"{'yes' if r['fits'] else 'NO'} (headroom {_gib(r['headroom_bytes'])})"),
        ("FLOPs/step, model (6 N + attention), global", f"{f['model_global']:.4g}"),
        ("FLOPs/step, program matmuls (jaxpr), global", f"{f['program_matmul_global']:.4g}"),
        ("FLOPs/step, XLA cost analysis, per device (loops once)", f"{xla_flops:.4g}"),
        ("MFU bound (model / program matmul FLOPs)", _pct(r["mfu_bound"])),
        (f"step time at peak ({r['peak_flops_per_device']:.4g} FLOP/s)", step_s),
        (f"lowers for {r['platform']}", _lowering(r["target_lowering"])),
    ]
    width = max(len(k) for k, _ in rows)
    head = (
        f"plan: {r['config']} ({_count(r['params'])} params), mesh {mesh} on {r['devices']} "
        f"x {r['device']}, batch {batch} x {seq} tokens\n"
        f"settings: {', '.join(f'{k}={v}' for k, v in r['settings'].items())}\n"
        f"bytes per device from the {r['bytes_source']}; compiled in {r['compile_seconds']} s\n"
    )
    lines = [f"| {'per device':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
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
