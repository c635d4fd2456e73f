"""Benchmarks: `python -m v41jax.bench NAME [--json PATH] ...` (or `python -m v41jax bench
NAME ...`) prints a table and writes JSON. `--help` lists them; `NAME --help` gives the
options of one. The device check (`scripts/device_check.sh`, `scripts/device_check.py`)
runs quick versions of several on a GPU/TPU."""

from __future__ import annotations

import argparse
import sys

# name -> (module, one line: what it measures)
BENCHMARKS = {
    "train": (
        "v41jax.bench.train_bench",
        "training tokens/s and model FLOP/s of a config vs this machine's matmul FLOP/s (MFU)",
    ),
    "engram": (
        "v41jax.bench.engram_bench",
        "Engram layer vs an equal-parameter FFN per token; lookup bytes/s vs memcpy",
    ),
    "mhc": (
        "v41jax.bench.mhc_bench",
        "mHC residual path bytes/token and time: plain, naive, fused, single pass",
    ),
    "mhc_train": (
        "v41jax.bench.mhc_train_bench",
        "mHC n=4 train-step overhead vs a plain residual (CPU time; compiled-TPU bytes)",
    ),
    "verify": (
        "v41jax.bench.verify_bench",
        "speculative verification time vs reading the probabilities once",
    ),
    "attention": (
        "v41jax.bench.attention_bench",
        "attention implementations: time, and the train step's compiled memory vs length",
    ),
    "compile": (
        "v41jax.bench.compile_bench",
        "train-step compile time and program size vs depth, scanned vs unrolled layers",
    ),
    "kernel_bytes": (
        "v41jax.bench.kernel_bytes_bench",
        "each Pallas kernel compiled for a TPU chip: its bytes vs its own model and the bound",
    ),
    "table_file": (
        "v41jax.bench.table_file_bench",
        "memory-mapped Engram table gathers: rows/s and page-cache hits vs table size",
    ),
    "tables": (
        "v41jax.bench.table_bench",
        "train-step time vs Engram table size, per table optimizer",
    ),
    "host_decode": (
        "v41jax.bench.host_decode_bench",
        "decode tokens/s with Engram tables on the device, in host memory, in a file",
    ),
    "decode": (
        "v41jax.bench.decode_bench",
        "plain `generate` ms/token vs a bare forward loop through the KV cache",
    ),
}


def usage() -> str:
    """The help text: how to call, then one line per benchmark."""
    width = max(len(n) for n in BENCHMARKS)
    lines = [
        "usage: python -m v41jax bench NAME [--json PATH] [options]",
        "       (the same as python -m v41jax.bench NAME ...; NAME --help: its options)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {n:<{width}}  {what}" for n, (_, what) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"error: unknown benchmark {argv[0]!r}; choose from {sorted(BENCHMARKS)}",
                file=sys.stderr,
            )
        print(usage())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    parser = argparse.ArgumentParser(
        prog=f"python -m v41jax.bench {argv[0]}", description=module.__doc__
    )
    module.add_args(parser)
    return module.run(parser.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
