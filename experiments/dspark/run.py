"""Regenerate the DSpark experiment: train the target and the drafters, then measure.

    python experiments/dspark/run.py [--runs-dir runs/dspark] [--stage all|train|eval] [--quick]

1. Train (resumable; finished runs are skipped): the target on the early speeches, its
   post-training stand-in (continued on the late speeches), 2048 samples of the target
   (`runs/dspark/texts/target_samples`), the drafters of config.DRAFTERS on those samples
   and those of config.ABLATIONS on the corpus (all with the frozen target's distributions),
   and the main drafter realigned to the post-trained target.
2. Evaluate on held-out prompts, sampling at config.TEMPERATURE (the exact acceptance rule):
   per-position acceptance and tokens per round of every drafter (fixed length K) with the
   throughput model's prediction, confidence calibration, wall-clock tokens/s of plain
   decoding and of each drafter at config.BATCHES, acceptance on the post-trained target
   before / after realignment, DSpark's fixed lengths 1..K vs the confidence scheduler
   (interleaved repeats at the largest batch), and tokens per round of every drafter at each
   of config.TEMPERATURES.
Writes results/summary.json, results/tables.md and PNGs (acceptance, reliability, throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module  # noqa: E402

C = experiment_module(HERE, "config")
write_report = experiment_module(HERE, "report").write_report

from v41jax import config as config_lib  # noqa: E402
from v41jax.bench.common import machine_info  # noqa: E402
from v41jax.data.corpus import split_speeches_by_year  # noqa: E402
from v41jax.dspark.analysis import round_logs as A  # noqa: E402
from v41jax.dspark.analysis.study import Decoder, drafter_stats, val_prompts  # noqa: E402
from v41jax.dspark.decode.engine import load_or_measure_cost  # noqa: E402
from v41jax.dspark.train.config import DrafterRunConfig  # noqa: E402
from v41jax.dspark.train.load import load_drafter  # noqa: E402
from v41jax.dspark.train.loop import train_drafter  # noqa: E402
from v41jax.dspark.train.replay import replay_policies, stack_rounds  # noqa: E402
from v41jax.dspark.train.self_text import write_target_samples  # noqa: E402
from v41jax.sweep import experiment_dirs  # noqa: E402
from v41jax.train import load_run, train  # noqa: E402


# ----------------------------------------------------------------------------- training
def _drafter_cfg(name: str, steps: int, data_dir: str | None = None) -> DrafterRunConfig:
    sets = C.DRAFTER_COMMON + {**C.DRAFTERS, **C.ABLATIONS}[name] + [f"train.steps={steps}"]
    if data_dir:
        sets.append(f"train.data_paths={data_dir}")
    return config_lib.override(DrafterRunConfig(), sets)


def _finished(result: dict) -> None:
    # A run stopped by a signal has checkpointed: stop here (later stages build on it), and
    # the same command continues.
    if result.get("stopped"):
        sys.exit("stopped by a signal; rerun the same command to continue")


def train_all(runs_dir: str) -> dict:
    early, late = split_speeches_by_year(os.path.join(runs_dir, "texts"), C.SPLIT_YEAR)
    w = {"target": os.path.join(runs_dir, "target"), "post": os.path.join(runs_dir, "post")}
    _finished(train(C.target_config(early), w["target"]))
    _finished(train(C.post_config(late, w["target"]), w["post"]))
    # The drafters of DRAFTERS learn from the target's own samples; ABLATIONS from its corpus.
    own = os.path.join(runs_dir, "texts", "target_samples")
    write_target_samples(load_run(w["target"]), own, **C.SELF_TEXT)
    for name in [*C.DRAFTERS, *C.ABLATIONS]:
        w[name] = os.path.join(runs_dir, "drafters", name)
        steps = C.DRAFTER_STEPS if name in C.DRAFTERS else C.ABLATION_STEPS
        on_own = name in C.DRAFTERS or name in C.SELF_TEXT_ABLATIONS
        cfg = _drafter_cfg(name, steps, own if on_own else None)
        _finished(train_drafter(cfg, w["target"], w[name]))
    # Realignment: on the post-trained target's own training text (its distributions).
    w["realigned"] = os.path.join(runs_dir, "drafters", f"{C.MAIN}_realigned")
    cfg = _drafter_cfg(C.MAIN, C.REALIGN_STEPS)
    _finished(train_drafter(cfg, w["post"], w["realigned"], init_from=w[C.MAIN]))
    return w


# ----------------------------------------------------------------------------- evaluation
def evaluate_all(w: dict) -> dict:
    target, post = load_run(w["target"]), load_run(w["post"])
    prompts = val_prompts(target, C.NUM_PROMPTS, C.PROMPT_LEN)
    dec, total = Decoder(target, prompts, C.NEW_TOKENS, C.SEED), C.NUM_PROMPTS * C.NEW_TOKENS
    drafters = {name: load_drafter(w[name]) for name in [*C.DRAFTERS, *C.ABLATIONS]}
    main_k = drafters[C.MAIN][0].drafter.block_size
    stats, rows = {}, []
    big = max(C.BATCHES)
    jobs = [(b, None, "plain", None) for b in C.BATCHES]
    jobs += [(b, n, "fixed", None) for b in C.BATCHES for n in C.DRAFTERS]
    jobs += [(b, C.MAIN, "scheduled", None) for b in C.BATCHES]
    jobs += [(big, n, "fixed", None) for n in C.ABLATIONS]

    def decode(job, first):  # (seconds of one pass, log); the first call compiles
        b, name, mode, length = job
        if mode == "plain":
            return dec.run(b, compile_first=first)
        cost = load_cost(w[name], target, drafters[name], b) if mode == "scheduled" else None
        kind = "scheduled" if mode == "scheduled" else "fixed"
        return dec.run(
            b, drafters[name], compile_first=first, mode=kind, verify_len=length, cost=cost
        )

    # Timing: TIMING_REPEATS passes over every job in turn (interleaved: this VM's speed
    # drifts by tens of percent within minutes), the fastest pass of each job counts.
    results = {job: decode(job, True) for job in tqdm(jobs, desc="decode")}
    for _ in tqdm(range(C.TIMING_REPEATS - 1), desc="timing passes"):
        for job in jobs:
            secs, _ = decode(job, False)
            results[job] = (min(results[job][0], secs), results[job][1])
    for b, name, mode, length in jobs:
        secs, log = results[(b, name, mode, length)]
        d = drafters.get(name)
        k = d[0].drafter.block_size if d else 0
        label = "plain" if name is None else f"{name} {mode}" + (f" L={length}" if length else "")
        row = {
            "name": label,
            "drafter": name,
            "mode": mode,
            "verify_len": length or k,
            "batch": b,
            "seconds": secs,
            "tokens_per_s": total / secs,
        }
        if log is not None:
            row["tokens_per_round"] = A.tokens_per_round(log["accepted"], log["active"])
            if b == big and length is None:
                stats[label] = drafter_stats(log, k)
        rows.append(row)
    # Realignment: the main drafter before / after, on the post-trained target's held-out text.
    post_dec = Decoder(post, val_prompts(post, C.NUM_PROMPTS, C.PROMPT_LEN), C.NEW_TOKENS, C.SEED)
    realign = {}
    for label, d in (("before", drafters[C.MAIN]), ("after", load_drafter(w["realigned"]))):
        _, log = post_dec.run(big, d)
        realign[label] = drafter_stats(log, main_k)
    main = drafters[C.MAIN]
    sched = scheduler_study(dec, main, load_cost(w[C.MAIN], target, main, big), big)
    temps = temperature_study(dec, drafters, big)
    return {
        "rows": rows,
        "stats": stats,
        "realignment": realign,
        "scheduler_study": sched,
        "temperature_study": temps,
    }


def rerun_scheduler_study(w: dict, out_dir: str) -> int:
    path = os.path.join(out_dir, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    target = load_run(w["target"])
    dec = Decoder(target, val_prompts(target, C.NUM_PROMPTS, C.PROMPT_LEN), C.NEW_TOKENS, C.SEED)
    main, big = load_drafter(w[C.MAIN]), max(C.BATCHES)
    cost = load_cost(w[C.MAIN], target, main, big)
    summary["scheduler_study"] = scheduler_study(dec, main, cost, big)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(write_report(summary, out_dir))
    return 0


def load_cost(workdir, target, d, batch):
    """The main drafter's round-cost table at this batch size (measured once, then reused)."""
    return load_or_measure_cost(workdir, target.params, target.cfg.model, d[1], d[0].drafter, batch)


def scheduler_study(dec: Decoder, drafter, cost, batch: int) -> dict:
    """The scheduler vs every fixed length at one batch size, SCHED_REPEATS interleaved passes
    (each configuration once per pass, all compiled first). Per configuration: tokens/s of
    every pass and their median; tokens per round and mean verify length; and the
    cost-model tokens/s (`A.modelled_seconds`: the logged rounds priced by the cost table,
    the comparison of policies this VM's drift cannot blur); loop rounds vs rounds per row
    (a static batch waits for its slowest row). Then the replay: REPLAY_PASSES decodes at
    fixed K with other seeds, every width policy and the oracle bound priced on their rounds
    (`v41jax.dspark.train.replay`)."""
    k = drafter[0].drafter.block_size
    configs = {f"fixed L={L}": dict(mode="fixed", verify_len=L) for L in range(1, k + 1)}
    # the same lengths on the scheduler's loop (host-driven rounds): the policy alone
    configs.update(
        {f"fixed L={L}, host loop": dict(verify_len=L, loop="host") for L in range(1, k + 1)}
    )
    configs["scheduled"] = dict(mode="scheduled", cost=cost)
    out = {n: {"tokens_per_s": []} for n in configs}
    total = C.NUM_PROMPTS * C.NEW_TOKENS
    one_batch = batch >= C.NUM_PROMPTS  # the log is one batch: its rounds can be costed
    for name, kw in configs.items():  # compile, and the round statistics
        _, log = dec.run(batch, drafter, **kw)
        out[name]["tokens_per_round"] = A.tokens_per_round(log["accepted"], log["active"])
        out[name]["mean_verify_len"] = float(log["verify_len"][log["active"]].mean())
        # a static batch runs until its slowest row is done: loop rounds vs rounds per row
        out[name]["loop_rounds"] = int(log["active"].any(axis=1).sum())
        out[name]["row_rounds"] = float(log["active"].sum(axis=0).mean())
        if one_batch:  # the same rounds priced by the measured cost table: no drift
            secs = A.modelled_seconds(log["verify_len"], log["active"], cost)
            out[name]["model_tokens_per_s"] = total / secs
    for _ in tqdm(range(C.SCHED_REPEATS), desc="scheduler vs fixed"):
        for name, kw in configs.items():
            secs, _ = dec.run(batch, drafter, compile_first=False, **kw)
            out[name]["tokens_per_s"].append(total / secs)
    for v in out.values():
        v["median_tokens_per_s"] = float(np.median(v["tokens_per_s"]))
    study = {"batch": batch, "cost_table": cost.to_dict(), "configs": out}
    if one_batch:  # every policy priced on the same logged rounds (v41jax.dspark.train.replay)
        logs = [
            dec.run(batch, drafter, compile_first=False, seed=C.SEED + i)[1]
            for i in tqdm(range(C.REPLAY_PASSES), desc="replay passes")
        ]
        # the engine's "width" basis and the budget rule priced at padded cost, for comparison
        bases = ("width", "padded")
        study["replay"] = replay_policies(**stack_rounds(logs), cost=cost, bases=bases)
    return study


def temperature_study(dec: Decoder, drafters: dict, batch: int) -> dict:
    """Acceptance and tokens per round of every drafter of DRAFTERS (fixed K) at batch
    `batch` for each of TEMPERATURES (one pass over all prompts, no timing)."""
    out = {}
    for temp in C.TEMPERATURES:
        for name in C.DRAFTERS:
            d = drafters[name]
            _, log = dec.run(batch, d, temperature=temp, compile_first=False)
            alpha, _ = A.acceptance_per_position(
                log["verify_len"], log["accepted"], log["active"], d[0].drafter.block_size
            )
            out.setdefault(str(temp), {})[name] = {
                "acceptance": [None if np.isnan(a) else float(a) for a in alpha],
                "tokens_per_round": A.tokens_per_round(log["accepted"], log["active"]),
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs-dir", help="default: runs/dspark (runs/dspark_quick with --quick)")
    ap.add_argument(
        "--out-dir",
        help="default: results/ next to this file; with --quick <runs-dir>/results, so a "
        "miniature never overwrites the committed results",
    )
    ap.add_argument(
        "--stage",
        choices=("all", "train", "eval", "scheduler"),
        default="all",
        help="scheduler: rerun only the scheduler-vs-fixed study into an existing summary.json",
    )
    ap.add_argument("--quick", action="store_true", help="a miniature of everything (tests)")
    args = ap.parse_args()
    setting = "quick" if args.quick else "full"
    args.runs_dir, args.out_dir = experiment_dirs(HERE, setting, args.runs_dir, args.out_dir)
    if args.quick:
        for name, value in C.QUICK.items():
            setattr(C, name, value)
    w = train_all(args.runs_dir)
    if args.stage == "train":
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    if args.stage == "scheduler":
        return rerun_scheduler_study(w, args.out_dir)
    result = evaluate_all(w)
    summary = {
        "setting": setting,
        "machine": machine_info(),
        "settings": {n: getattr(C, n) for n in dir(C) if n.isupper() and n != "QUICK"},
        "training": {n: json.load(open(os.path.join(w[n], "eval.json"))) for n in w},
        **result,
    }
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(write_report(summary, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
