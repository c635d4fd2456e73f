"""Regenerate the Engram-at-scale experiment: train every cell, measure it, tables and plots.

    python experiments/engram_scale/run.py [--setting full|quick] [--runs-dir D] [--out-dir D]

Each cell (table params, placement, optimizer; see config.py) is a v41jax workdir trained
with the ordinary training loop, so a rerun resumes a killed cell and skips finished ones
(their measurements are cached in `<workdir>/cell.json`). Per cell:

- step_ms: median train-step time (from metrics.jsonl, the first logged interval, which
  pays for compilation, left out);
- val_loss at the same number of steps;
- device_bytes: the train state on the device (params + optimizer state, from the abstract
  state), host_bytes: the tables and their optimizer state in host memory, disk_bytes: the
  disk blocks the table files really hold (a lazy file stores only rows training wrote);
- decode tokens/s at batch 1 and 8 (`generate`, 32 new tokens, fastest of 3 after warm-up),
  with the tables where training kept them (host and file tables read by a host callback).

Writes summary.json, tables.md, step_time.png, val_loss.png and decode.png to the results
directory (the committed `results/` for `full`; `<runs-dir>/results` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module  # noqa: E402

C = experiment_module(HERE, "config")
report = experiment_module(HERE, "report")

from v41jax.decode import generate  # noqa: E402
from v41jax.engram import table_optim  # noqa: E402
from v41jax.engram.primes import stored_table_rows  # noqa: E402
from v41jax.engram.training.file_arrays import table_dir  # noqa: E402
from v41jax.sharding import make_mesh  # noqa: E402
from v41jax.sweep import experiment_dirs, record_setting  # noqa: E402
from v41jax.train import load_run, train  # noqa: E402
from v41jax.train.metrics import read_metrics  # noqa: E402
from v41jax.train.state import make_state_fns  # noqa: E402

DECODE_BATCHES, NEW_TOKENS = (1, 8), 32


def state_bytes(cfg) -> tuple[int, int]:
    """(device bytes of the train state, host bytes of the tables and their state)."""
    _, _, _, _, abstract = make_state_fns(cfg, make_mesh(cfg.mesh))
    device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    engram = cfg.model.engram
    if engram.table_placement != "host" or engram.table_path:
        return device, 0
    host = 0
    for layer in engram.layer_ids:
        rows = stored_table_rows(engram, layer)
        host += rows * engram.head_dim * 4
        host += table_optim.state_bytes(cfg.optim.table_optimizer, rows, engram.head_dim)
    return device, host


def decode_tokens_per_s(workdir: str) -> dict[str, float]:
    run = load_run(workdir)  # the tables stay where training kept them
    out = {}
    for b in DECODE_BATCHES:
        rng = np.random.default_rng(b)
        prompts = rng.integers(1, run.cfg.model.vocab_size, (b, 8)).astype(np.int32)
        lengths = np.full((b,), 8, np.int32)

        def call(run=run, prompts=prompts, lengths=lengths):
            return generate(
                run.params, run.cfg.model, prompts, lengths, max_new_tokens=NEW_TOKENS,
                compression=run.compression.table,
            )  # fmt: skip

        jax.block_until_ready(call())
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(call())
            best = min(best, time.perf_counter() - start)
        out[f"decode_tok_s_b{b}"] = b * NEW_TOKENS / best
    return out


def measure(cell, cfg, workdir: str, result: dict) -> dict:
    path = os.path.join(workdir, "cell.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    rows = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "tokens_per_s" in r]
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    step_ms = [1e3 * tokens / r["tokens_per_s"] for r in rows[1:]] or [float("nan")]
    device, host = state_bytes(cfg)
    disk = 0
    if cfg.model.engram.table_path:
        root = table_dir(cfg, workdir)
        disk = sum(os.stat(os.path.join(d, n)).st_blocks * 512
                   for d, _, ns in os.walk(root) for n in ns)  # fmt: skip
    size, place, opt = cell
    entry = {
        "table_params": size, "placement": place, "optimizer": opt,
        "steps": cfg.train.steps, "val_loss": result["val_loss"],
        "step_ms": float(np.median(step_ms)), "device_bytes": device, "host_bytes": host,
        "disk_bytes": disk, **decode_tokens_per_s(workdir),
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(entry, f, indent=2)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--setting", default="full", choices=sorted(C.SETTINGS))
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    runs_dir, out_dir = experiment_dirs(HERE, args.setting, args.runs_dir, args.out_dir)
    record_setting(runs_dir, __file__, args.setting)
    os.makedirs(out_dir, exist_ok=True)
    summary = []
    for cell in C.cells(args.setting):
        cfg = C.get_config(cell, args.setting)
        workdir = os.path.join(runs_dir, C.cell_name(cell))
        print(f"== {C.cell_name(cell)}", flush=True)
        result = train(cfg, workdir, progress=args.progress)
        if result.get("stopped"):  # SIGTERM / Ctrl-C: checkpoint saved, nothing to measure
            print(f"stopped at step {result['step']} of {C.cell_name(cell)}: run the same "
                  "command again to resume it")  # fmt: skip
            return 1
        summary.append(measure(cell, cfg, workdir, result))
        jax.clear_caches()  # each cell compiles its own shapes; free the last cell's
        del result
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"setting": args.setting, "cells": summary}, f, indent=2)
    tables = report.render_tables({"setting": args.setting, "cells": summary})
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(tables)
    report.plots(summary, out_dir)
    print(tables)
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
