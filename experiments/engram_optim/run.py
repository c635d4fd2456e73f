"""Regenerate the Engram table-optimizer study: train every run, measure it, tables and plots.

    python experiments/engram_optim/run.py [--setting full|quick] [--runs-dir D] [--out-dir D]
                                           [--limit N]

Each run (config.py) is a v41jax workdir trained by the ordinary training loop, so the same
command again resumes a killed run from its last checkpoint and skips finished ones (their
measurements are cached in `<workdir>/cell.json`); `--limit N` stops after N runs trained,
so the study can be run a few hours at a time. Stage 2 (the other seeds at each arm's best
lr) starts for a table size once all of its stage-1 runs are measured. Per run:

- val_loss: validation loss after the run's steps (every run: the same batches);
- rare_loss: the loss on the validation tokens whose preceding bigram (compressed ids) is
  rare in the training stream (seen fewer than 10 times: `v41jax.sweep.analysis`, the split of
  experiments/engram_vs_ffn);
- state_bytes: the optimizer state on the device (from the abstract train state);
  table_state_bytes: the part that belongs to the Engram tables;
- step_ms: the median train-step time from metrics.jsonl (the first logged interval, which
  pays for compilation, left out).

After every run, summary.json ({"setting", "machine", "commit", "runs": [...], "pending"}),
tables.md and the PNGs are written again, so a study cut short still reports what it has.

The runs' own step times are only as quiet as the machine was over hours of training;
`--time` measures the arms side by side instead (timing.json: per table size, every arm's
train step built at once, its steps taken in turn pass by pass on the same Zipf-distributed
synthetic batches, median over the passes; with each arm's optimizer state bytes), and the
tables quote those when they exist.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module, git_commit  # noqa: E402

C = experiment_module(HERE, "config")
report = experiment_module(HERE, "report")

from v41jax.bench.common import machine_info, time_interleaved  # noqa: E402
from v41jax.bench.table_bench import synthetic_batch  # noqa: E402
from v41jax.engram import table_optim  # noqa: E402
from v41jax.engram.primes import stored_table_rows  # noqa: E402
from v41jax.sharding import make_mesh  # noqa: E402
from v41jax.sweep import experiment_dirs, record_setting  # noqa: E402
from v41jax.sweep.analysis import analyze_run  # noqa: E402
from v41jax.train import train  # noqa: E402
from v41jax.train.metrics import read_metrics  # noqa: E402
from v41jax.train.state import make_state_fns  # noqa: E402
from v41jax.train.step import device_batch, make_train_step  # noqa: E402

TIMING_PASSES, TIMING_LR = 10, 3e-3


def state_bytes(cfg) -> tuple[int, int]:
    """(bytes of the whole optimizer state, bytes of the tables' part of it)."""
    _, _, _, _, abstract = make_state_fns(cfg, make_mesh(cfg.mesh))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state))
    engram, kind = cfg.model.engram, cfg.optim.tables_trained_by
    tables = sum(
        table_optim.state_bytes(kind, stored_table_rows(engram, layer), engram.head_dim)
        for layer in engram.layer_ids
    )
    return int(total), int(tables)


def measure(run, cfg, workdir: str, result: dict) -> dict:
    path = os.path.join(workdir, "cell.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    rows = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "tokens_per_s" in r]
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    step_ms = [1e3 * tokens / r["tokens_per_s"] for r in rows[1:]] or [float("nan")]
    split = analyze_run(workdir, engram_off=False, num_batches=cfg.train.eval_batches)
    total, tables = state_bytes(cfg)
    size, opt, recipe, lr, seed = run
    entry = {
        "optimizer": opt,
        "recipe": recipe,
        "placement": cfg.model.engram.table_placement,
        "table_params": size,
        "table_params_exact": int(
            sum(
                stored_table_rows(cfg.model.engram, layer) * cfg.model.engram.head_dim
                for layer in cfg.model.engram.layer_ids
            )
        ),
        "lr": lr,
        "seed": seed,
        "steps": cfg.train.steps,
        "val_loss": result["val_loss"],
        "rare_loss": split["groups"]["context_bigram"]["rare"]["loss"],
        "rare_share": split["groups"]["context_bigram"]["rare"]["share"],
        "state_bytes": total,
        "table_state_bytes": tables,
        "step_ms": float(np.median(step_ms)),
        "machine": machine(),
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(entry, f, indent=2)
    os.replace(tmp, path)
    return entry


def machine() -> dict:
    """`bench.common.machine_info`, with the CPU's model name where Linux says it."""
    info = machine_info()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["processor"] = names[0]
    except OSError:
        pass
    return info


def best_lrs(measured: dict, setting: str) -> dict:
    """{arm: lr} for the arms whose stage-1 runs are all measured: the lowest val loss."""
    out = {}
    for run in C.first_stage(setting):
        key = C.arm(run)
        runs = [r for r in C.first_stage(setting) if C.arm(r) == key]
        if all(r in measured for r in runs):
            out[key] = min(runs, key=lambda r: measured[r]["val_loss"])[3]
    return out


def time_arms(setting: str, passes: int = TIMING_PASSES) -> dict:
    """Side-by-side train-step times of every arm, per table size (module doc)."""
    rows = []
    for size in C.SETTINGS[setting]["sizes"]:
        arms = {}  # arm -> [step fn, state, batches, steps taken]
        held = {}  # arm -> (optimizer state bytes, the tables' part)
        for run in C.first_stage(setting):
            if run[0] != size or run[3] != C.SETTINGS[setting]["lrs"][0]:
                continue
            run = (*run[:3], TIMING_LR, run[4])
            cfg = C.get_config(run, setting)
            mesh = make_mesh(cfg.mesh)
            model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
            step = make_train_step(cfg, mesh, model, optimizer, shardings)
            batches = [device_batch(mesh, synthetic_batch(cfg, i)) for i in range(2)]
            name = C.run_name(run).split("/")[1].split("_lr")[0]
            arms[name] = [step, init_fn(0), batches, 0]
            held[name] = state_bytes(cfg)

        def one_step(arm: str, arms=arms):
            step, state, batches, taken = arms[arm]
            state, metrics = step(state, batches[taken % 2])
            arms[arm][1:] = [state, batches, taken + 1]
            return metrics["loss"]

        calls = {arm: functools.partial(one_step, arm) for arm in arms}
        for call in calls.values():  # compile, then one step more so donation has settled
            for _ in range(2):
                jax.block_until_ready(call())
        times = time_interleaved(calls, passes=passes)
        base = float(np.median(times["adam_5x"])) if "adam_5x" in times else None
        for arm, ts in times.items():
            ms = 1e3 * float(np.median(ts))
            rows.append(
                {
                    "table_params": size,
                    "arm": arm,
                    "step_ms": ms,
                    "step_ms_min": 1e3 * min(ts),
                    "passes": passes,
                    "vs_adam_5x": ms / 1e3 / base if base else None,
                    "state_bytes": held[arm][0],
                    "table_state_bytes": held[arm][1],
                }
            )
        del calls, arms
        jax.clear_caches()
    return {"setting": setting, "machine": machine(), "commit": git_commit(HERE), "rows": rows}


def write_results(out_dir: str, setting: str, measured: dict, pending: list) -> str:
    runs = [measured[r] for r in [*C.first_stage(setting), *sorted(set(measured) - set(
        C.first_stage(setting)))] if r in measured]  # fmt: skip
    summary = {
        "setting": setting,
        "grid": {k: v for k, v in C.SETTINGS[setting].items()},
        "machine": machine(),
        "commit": git_commit(HERE),
        "runs": runs,
        "pending": [C.run_name(r) for r in pending],
    }
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "summary.json"))
    timing = report.read_timing(out_dir)
    tables = report.render_tables(summary, timing)
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write(tables)
    report.plots(summary, out_dir)
    return tables


def committed_runs(out_dir: str, setting: str) -> dict:
    """The finished runs in <out_dir>/summary.json (committed with the experiment), by run
    key (table params, optimizer, recipe, lr, seed), when it was written for this setting
    and grid: a machine whose runs dir is empty (a fresh clone) continues the study instead
    of retraining them. A row keeps the machine it ran on (rows written before rows carried
    one take the summary's)."""
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            summary = json.load(f)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path} is damaged ({e}); move it away to start afresh") from e
    grid = json.loads(json.dumps(C.SETTINGS[setting]))
    if summary.get("setting") != setting or summary.get("grid") != grid:
        return {}
    return {
        (r["table_params"], r["optimizer"], r["recipe"], r["lr"], r["seed"]):
        {**r, "machine": r.get("machine", summary.get("machine"))}
        for r in summary["runs"]
    }  # fmt: skip


def planned(setting: str, measured: dict) -> list:
    """Every run to do now: stage 1, and stage 2 of the arms whose stage 1 is measured."""
    return C.first_stage(setting) + C.second_stage(setting, best_lrs(measured, setting))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--setting", default="full", choices=sorted(C.SETTINGS))
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--limit", type=int, default=0, help="train at most N runs, then stop")
    p.add_argument("--time", action="store_true", help="write timing.json (side by side), only")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    runs_dir, out_dir = experiment_dirs(HERE, args.setting, args.runs_dir, args.out_dir)
    if args.time:
        timing = time_arms(args.setting)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "timing.json"), "w") as f:
            json.dump(timing, f, indent=2)
        for row in timing["rows"]:
            print(f"{row['table_params']:.0e} {row['arm']:>16}: {row['step_ms']:8.1f} ms "
                  f"({row['vs_adam_5x']:.2f}x adam_5x)")  # fmt: skip
        return 0
    record_setting(runs_dir, __file__, args.setting)
    measured: dict = committed_runs(out_dir, args.setting)
    for run in planned(args.setting, measured):  # cached measurements first
        path = os.path.join(runs_dir, C.run_name(run), "cell.json")
        if os.path.exists(path):
            with open(path) as f:
                measured[run] = json.load(f)
    trained = 0
    while True:
        todo = [r for r in planned(args.setting, measured) if r not in measured]
        if not todo or (args.limit and trained >= args.limit):
            break
        run = todo[0]
        cfg = C.get_config(run, args.setting)
        workdir = os.path.join(runs_dir, C.run_name(run))
        print(f"== {C.run_name(run)} ({len(todo)} to go)", flush=True)
        result = train(cfg, workdir, progress=args.progress)
        if result.get("stopped"):  # SIGTERM / Ctrl-C: checkpoint saved, nothing to measure
            print(f"stopped at step {result['step']} of {C.run_name(run)}: run the same "
                  "command again to resume it")  # fmt: skip
            return 1
        measured[run] = measure(run, cfg, workdir, result)
        trained += 1
        jax.clear_caches()  # each run compiles its own shapes; free the last one's
        pending = [r for r in planned(args.setting, measured) if r not in measured]
        write_results(out_dir, args.setting, measured, pending)
    pending = [r for r in planned(args.setting, measured) if r not in measured]
    print(write_results(out_dir, args.setting, measured, pending))
    print(f"wrote {out_dir} ({len(measured)} runs measured, {len(pending)} to go)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
