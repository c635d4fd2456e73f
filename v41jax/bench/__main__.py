"""Benchmarks: `python -m v41jax.bench NAME [--json PATH] ...` prints a table, writes JSON.

train   training tokens/s and model FLOP/s of a config vs this machine's matmul FLOP/s
engram  Engram layer vs an equal-parameter FFN per token; lookup bytes/s vs memcpy
mhc     residual-path bytes/token and time: plain, naive, fused, single-pass mHC
verify  speculative verification time vs the read-once bound of the probabilities
attention  attention implementations: time, compiled memory of the train step vs length
compile    train-step compile time and program size vs depth (scanned vs unrolled layers)
table_file  memory-mapped Engram table gathers: rows/s and page-cache hits vs table size
tables     train-step time vs Engram table size per table optimizer
host_decode  decode tokens/s with Engram tables on device, in host memory, in a file
decode     plain `generate` ms/token vs a bare forward loop through the KV cache
"""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = {
    "train": "v41jax.bench.train_bench",
    "engram": "v41jax.bench.engram_bench",
    "mhc": "v41jax.bench.mhc_bench",
    "verify": "v41jax.bench.verify_bench",
    "attention": "v41jax.bench.attention_bench",
    "compile": "v41jax.bench.compile_bench",
    "table_file": "v41jax.bench.table_file_bench",
    "tables": "v41jax.bench.table_bench",
    "host_decode": "v41jax.bench.host_decode_bench",
    "decode": "v41jax.bench.decode_bench",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"error: unknown benchmark {argv[0]!r}; choose from {sorted(BENCHMARKS)}",
                file=sys.stderr,
            )
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(BENCHMARKS[argv[0]])
    parser = argparse.ArgumentParser(
        prog=f"python -m v41jax.bench {argv[0]}", description=module.__doc__
    )
    module.add_args(parser)
    return module.run(parser.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
