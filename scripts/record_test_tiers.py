"""Time the test tiers on this machine and record them: experiments/test_tiers/tiers.json.

    python scripts/record_test_tiers.py                 # smoke tier, then the whole test command
    python scripts/record_test_tiers.py --tiers smoke   # one tier

Each tier is the README's own command (`bash scripts/test.sh --smoke`, `bash scripts/test.sh`),
run as a subprocess with its output passed through; the record holds its wall time, exit
status, pytest's summary lines (tests passed / skipped / failed per pytest run: the whole
command runs two, the fast suite and the compile tier) and the machine and commit it ran on.
A tier that fails is recorded as failed, never dropped. Nothing else should run meanwhile:
the suite is mostly single-threaded XLA compilation, so another job on the cores shows up
directly in its time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "test_tiers", "tiers.json")
TIERS = {
    "smoke": ["bash", "scripts/test.sh", "--smoke"],
    "full": ["bash", "scripts/test.sh"],
}
# pytest's final line, e.g. "==== 1472 passed, 93 skipped, 2 deselected in 1401.23s (0:23:21) ===="
SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|error).*) in ([\d.]+)s.*=+$")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib}


def counts(summary: str) -> dict:
    """'1472 passed, 93 skipped, 2 deselected' -> {'passed': 1472, ...}."""
    return {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", summary)}


def run_tier(name: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(
        TIERS[name], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    runs = []
    for line in proc.stdout:
        sys.stdout.write(line)
        m = SUMMARY.match(line.strip())
        if m:
            runs.append(
                {
                    "summary": m.group(1),
                    "counts": counts(m.group(1)),
                    "pytest_seconds": float(m.group(2)),
                }
            )
    rc = proc.wait()
    return {
        "command": " ".join(TIERS[name]),
        "seconds": round(time.perf_counter() - start, 1),
        "exit_status": rc,
        "passed": rc == 0,
        "pytest_runs": runs,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", default="smoke,full", help="comma-separated: smoke, full")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        ap.error(f"unknown tier(s) {unknown}; known: {sorted(TIERS)}")
    record = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            record = json.load(f)  # a damaged file fails here, named by the traceback
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for name in tiers:
        result = run_tier(name)
        result.update(
            commit=commit,
            uncommitted_changes=dirty,
            machine=machine(),
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        record[name] = result
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.out)
        print(f"{name}: {result['seconds']:.0f} s, exit {result['exit_status']} -> {args.out}")
    return 0 if all(record[t]["passed"] for t in tiers) else 1


if __name__ == "__main__":
    sys.exit(main())
