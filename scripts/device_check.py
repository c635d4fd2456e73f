"""One command for a machine with a GPU or TPU: `bash scripts/device_check.sh`.

Runs, each under its own timeout and all within `--budget` seconds from the start, probe and
wheel install included (default 540, so the whole fits in 10 minutes on one H100/H200):
  kernel_tests     the compiled twins of the kernel tests (`pytest tests/kernels -k compiled`)
  train            20 steps of the tiny config (`python -m v41jax train --config tiny`)
  bench_<name>     the kernel benchmarks in a quick form (`python -m v41jax.bench <name>`):
                   `--quick` where a benchmark has it, else small sizes among its own flags
and writes ONE JSON (chip, memory, driver, versions, each stage's status, duration, output
tail, the benchmarks' JSON) to `--out` (default `$OUT/device_check.json` when OUT is set,
else `./device_check.json`), rewritten after every stage so a killed run still leaves one.
A failed benchmark is recorded, not fatal; the exit status is 0 when the kernel tests and
the training run passed.

Without an accelerator (the probe's `jax.default_backend()` is cpu, e.g. JAX_PLATFORMS=cpu)
it prints the plan and exits 0. Nothing is downloaded: wheels missing from this Python are
installed from the checkout's `.whl/` folder (`pip install --no-index --no-deps --target`),
and only those whose distribution is not installed already (a preinstalled jax wins).
It and `device_env` (beside it in scripts/) import only the standard library, so they run
before any wheel is installed; neither is part of the v41jax package (nothing there imports
them): `scripts/device_check.sh` runs this file as a script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from device_env import (  # scripts/device_env.py: run as a script, its folder is on sys.path
    ROOT,
    host_info,
    install_wheels,
    probe,
    run_command,
    select_wheels,
    versions_line,
)

BENCHMARKS = ("mhc", "engram", "verify", "attention", "host_decode")
# Small sizes per benchmark flag, used only for flags the benchmark's --help lists (their
# flags change while --quick modes are added): a missing flag is left out, not an error.
QUICK_FALLBACK = {
    "engram": {"--sizes": "1e6,1e8", "--ffn-max-params": "1e8", "--tokens": "2048", "--iters": "3"},
    "mhc": {"--tokens": "4096", "--iters": "5", "--rounds": "1"},
    "verify": {"--vocabs": "32000,128000", "--iters": "5", "--rounds": "1"},
    "attention": {"--iters": "3", "--rounds": "1"},
}
TIMEOUTS = {"kernel_tests": 150, "train": 120, "bench": 50}


@dataclass
class Stage:
    """One step of the check: a command run from the repository root under `timeout_s`."""

    name: str
    command: list[str]
    timeout_s: float
    required: bool = False  # counts for the exit status
    json_path: str | None = None  # a benchmark's --json output, read into the record


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def bench_args(name: str, help_text: str, json_path: str) -> list[str]:
    """Arguments for a quick run of benchmark `name`, from the flags its --help lists."""
    args = ["--quick"] if re.search(r"--quick\b", help_text) else []
    if not args:
        for flag, value in QUICK_FALLBACK.get(name, {}).items():
            if re.search(re.escape(flag) + r"\b", help_text):
                args += [flag, value]
    if re.search(r"--json\b", help_text):
        args += ["--json", json_path]
    return args


def plan_stages(workdir: str, names: list[str] | None = None) -> list[Stage]:
    py = sys.executable
    pytest = "-m pytest tests/kernels -k compiled -p no:randomly -p no:cacheprovider -q -rfEs"
    train = "-m v41jax train --config tiny --set train.steps=20 --set train.eval_every=0"
    junit = f"--junitxml={os.path.join(workdir, 'kernel_tests.xml')}"
    train_dir = ["--workdir", os.path.join(workdir, "train"), "--no-progress"]
    stages = [
        Stage("kernel_tests", [py, *pytest.split(), junit], TIMEOUTS["kernel_tests"], True),
        Stage("train", [py, *train.split(), *train_dir], TIMEOUTS["train"], True),
    ]
    for name in BENCHMARKS:
        path = os.path.join(workdir, f"bench_{name}.json")
        cmd = [py, "-m", "v41jax.bench", name, "<quick flags from its --help>"]
        stages.append(Stage(f"bench_{name}", cmd, TIMEOUTS["bench"], json_path=path))
    if names:
        unknown = sorted(set(names) - {s.name for s in stages})
        if unknown:
            raise ValueError(f"unknown stages {unknown}; choose from {[s.name for s in stages]}")
        stages = [s for s in stages if s.name in names]
    return stages


def _finish_stage(stage: Stage, env: dict, timeout_s: float, log_path: str) -> dict:
    if stage.json_path:  # a benchmark: its flags come from its own --help
        name = stage.name.removeprefix("bench_")
        helped = run_command([*stage.command[:4], "--help"], min(timeout_s, 60), env, log_path)
        if helped["status"] != "passed":
            return dict(helped, status="failed", note="its --help failed (benchmark missing?)")
        with open(log_path, errors="replace") as f:
            stage.command = [*stage.command[:4], *bench_args(name, f.read(), stage.json_path)]
        timeout_s -= helped["duration_s"]
    result = run_command(stage.command, timeout_s, env, log_path)
    if stage.json_path and os.path.isfile(stage.json_path):
        with open(stage.json_path) as f:
            result["json"] = json.load(f)
    if stage.name == "kernel_tests":
        result.update(junit_counts(os.path.join(os.path.dirname(log_path), "kernel_tests.xml")))
        if result["status"] == "passed" and not result.get("passed_tests"):
            result["status"] = "no_tests"  # every compiled twin skipped: nothing was checked
    if stage.name == "train" and result["status"] == "passed":
        with open(log_path, errors="replace") as f:  # the CLI prints its result JSON last
            blocks = re.findall(r"^\{$.*?^\}$", f.read(), re.M | re.S)
        if blocks:
            result["result"] = json.loads(blocks[-1])
        metrics = os.path.join(os.path.dirname(log_path), "train", "metrics.jsonl")
        if os.path.isfile(metrics):  # first and last logged losses: did it learn at all
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if '"loss"' in line]
            result["metrics_first_last"] = rows[:1] + rows[-1:]
    return result


def junit_counts(path: str) -> dict:
    import xml.etree.ElementTree as ET

    if not os.path.isfile(path):
        return {}
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed_tests"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return n


def write_report(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


def run_check(
    stages: list[Stage], report: dict, out: str, env: dict, workdir: str, budget_s: float
) -> int:
    """Run `stages` in order within `budget_s`, rewriting `out` after each; exit status."""
    start = time.monotonic()
    report["stages"] = []
    for stage in stages:
        left = budget_s - (time.monotonic() - start)
        record = {"name": stage.name, "command": stage.command, "timeout_s": stage.timeout_s}
        if left < 15:
            record.update(
                status="skipped", note=f"budget ran out ({budget_s:.0f} s were left for stages)"
            )
        else:
            timeout = min(stage.timeout_s, left)
            print(f"[device_check] {stage.name} (timeout {timeout:.0f} s) ...", flush=True)
            log = os.path.join(workdir, f"{stage.name}.log")
            record.update(_finish_stage(stage, env, timeout, log), command=stage.command)
            print(
                f"[device_check] {stage.name}: {record['status']} "
                f"({record.get('duration_s', 0):.0f} s)",
                flush=True,
            )
        report["stages"].append(record)
        report["total_s"] = round(time.monotonic() - start, 1)
        write_report(out, report)
    report["finished_utc"] = _now()
    failed = [s["name"] for s in report["stages"] if s["status"] != "passed"]
    report["summary"] = {
        "failed_or_skipped": failed,
        "passed": [s["name"] for s in report["stages"] if s["status"] == "passed"],
    }
    write_report(out, report)
    required = {s.name for s in stages if s.required}
    return 1 if required & set(failed) else 0


def default_out() -> str:
    out_dir = os.environ.get("OUT")
    return os.path.join(out_dir, "device_check.json") if out_dir else "device_check.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/device_check.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=None, help="the JSON report (default: $OUT or ./)")
    p.add_argument(
        "--budget", type=float, default=540.0, help="seconds for everything (setup included)"
    )
    p.add_argument("--stages", default="", help="comma list of stages to run (default: all)")
    p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="offline wheel folder")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="run the stages even on CPU (to test this script; compiled twins then skip)",
    )
    p.add_argument("--python-reason", default="the interpreter running this module")
    args = p.parse_args(argv)
    started = time.monotonic()  # the budget covers the probe and wheel install too
    if args.budget <= 0:
        raise SystemExit(f"error: --budget={args.budget} must be > 0 seconds")
    out = os.path.abspath(args.out or default_out())
    # The scratch folder is made only when stages run; the plan shows a placeholder.
    workdir = args.workdir or os.path.join(tempfile.gettempdir(), "v41jax_device_check_<id>")
    try:
        stages = plan_stages(workdir, [s for s in args.stages.split(",") if s])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
    )
    print(
        f"[device_check] python: {sys.executable} ({sys.version.split()[0]}; "
        f"chosen because: {args.python_reason})"
    )
    found = probe(env)
    wheels = select_wheels(args.wheels, bool(os.environ.get("V41JAX_WHEELS_ALL")))
    accelerator = found.get("backend") in ("gpu", "tpu") or (args.force and "error" not in found)
    installed = None
    if not args.dry_run and (accelerator or "error" in found):
        workdir = args.workdir or tempfile.mkdtemp(prefix="v41jax_device_check_")
        os.makedirs(workdir, exist_ok=True)
        stages = plan_stages(workdir, [s for s in args.stages.split(",") if s])
    if wheels["install"] and not args.dry_run and (accelerator or "error" in found):
        site = os.path.join(workdir, "site")  # fresh per run: no stale packages
        installed = install_wheels(wheels["install"], site, env, os.path.join(workdir, "w.log"))
        env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        sys.path.insert(0, site)  # so host_info sees their versions
        found = probe(env)
        accelerator = found.get("backend") in ("gpu", "tpu") or (
            args.force and "error" not in found
        )
    what = f"{found.get('backend')} {[d['kind'] for d in found.get('devices', [])][:1]}"
    error = f" ({found['error']})" if "error" in found else ""
    print(f"[device_check] jax backend: {what}{error}")
    host = host_info()
    versions = versions_line(host["package_versions"], host["requirements_pins"])
    print(f"[device_check] versions: {versions}")
    names = [os.path.basename(w) for w in wheels["install"]]
    print(
        f"[device_check] wheels from {args.wheels}: install {names or 'none'}; "
        f"already present {len(wheels['present'])}; incompatible {wheels['incompatible']}"
    )
    if not accelerator or args.dry_run:
        print(
            "[device_check] no GPU/TPU backend: nothing run. The plan on an accelerator:"
            if not accelerator
            else "[device_check] --dry-run: the plan:"
        )
        print("  JAX_PLATFORMS=<cuda|tpu|rocm>, each stage from the repository root:")
        for s in stages:
            print(f"  {s.name:16s} timeout {s.timeout_s:4.0f} s: {' '.join(s.command)}")
        print(f"  report -> {out}")
        return 0
    env.update(JAX_PLATFORMS=found["platform"], V41JAX_CACHE=os.path.join(workdir, "cache"))
    report = {
        "schema": "v41jax-device-check/1",
        "started_utc": _now(),
        "out": out,
        "workdir": workdir,
        "python_chosen_because": args.python_reason,
        "jax_platforms": found["platform"],
        "device": found,
        **host,
        "wheels": dict(wheels, result=installed),
    }
    print(f"[device_check] writing {out}", flush=True)
    left = args.budget - (time.monotonic() - started)
    rc = run_check(stages, report, out, env, workdir, left)
    print(
        f"[device_check] passed: {report['summary']['passed']}; "
        f"failed or skipped: {report['summary']['failed_or_skipped']}"
    )
    print(f"[device_check] report: {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
