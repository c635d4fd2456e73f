"""DSpark against a deep target: train the target and the drafters, then measure.

    python experiments/dspark_deep/run.py [--runs-dir D] [--out-dir R] [--stage all|train]
                                          [--quick]

1. Train (resumable: a finished run is skipped, an interrupted one continues from its last
   checkpoint when the same command runs again): the 24-layer target on the early speeches,
   samples of its own text (config.SELF_TEXT), and every drafter of config.DRAFTERS on
   those samples against the frozen target (all of them from one target pass per step:
   `train_drafters`).
2. Measure: the round-cost tables (`measure_round_cost`, widths 0..K, saved in the
   drafter's workdir) of every drafter at config.COSTS_OF_EVERY_DRAFTER_AT and of the
   scheduled drafters at every batch size, and its drafter pass alone
   (`measure_draft_cost`), read as c and v(L) in plain decode rounds; acceptance per position,
   tokens per round and calibration of every drafter at fixed K (batch 32, temperature 1);
   wall-clock tokens/s of every decoder of config.DECODERS at every batch and temperature
   (interleaved passes, fastest and median); the scheduler against plain decoding and every
   fixed length at config.SCHED_BATCHES, with the replay's oracle bound.
Writes results/summary.json, results/tables.md and the PNGs (report.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module  # noqa: E402

C = experiment_module(HERE, "config")
write_report = experiment_module(HERE, "report").write_report

from v41jax.bench.common import machine_info  # noqa: E402
from v41jax.data.corpus import split_speeches_by_year  # noqa: E402
from v41jax.dspark.analysis import round_logs as A  # noqa: E402
from v41jax.dspark.analysis.study import Decoder, drafter_stats, time_interleaved, val_prompts  # noqa: E402
from v41jax.dspark.decode.engine import load_or_measure_cost, load_or_measure_draft_cost  # noqa: E402
from v41jax.dspark.train.config import DrafterRunConfig, override_run_config  # noqa: E402
from v41jax.dspark.train.load import load_drafter  # noqa: E402
from v41jax.dspark.train.loop import train_drafters  # noqa: E402
from v41jax.dspark.train.replay import replay_policies, stack_rounds  # noqa: E402
from v41jax.dspark.train.self_text import write_target_samples  # noqa: E402
from v41jax.sweep import experiment_dirs  # noqa: E402
from v41jax.train import load_run, train  # noqa: E402


def _finished(result: dict) -> None:
    # A run stopped by a signal has checkpointed; later stages build on it.
    if result.get("stopped"):
        sys.exit("stopped by a signal; rerun the same command to continue")


def train_all(runs_dir: str) -> dict:
    early, _ = split_speeches_by_year(os.path.join(runs_dir, "texts"), C.SPLIT_YEAR)
    w = {"target": os.path.join(runs_dir, "target")}
    _finished(train(C.target_config(early), w["target"]))
    own = os.path.join(runs_dir, "texts", "target_samples")
    write_target_samples(load_run(w["target"]), own, **C.SELF_TEXT)
    cfgs = {}
    for name, sets in C.DRAFTERS.items():
        w[name] = os.path.join(runs_dir, "drafters", name)
        extra = [f"train.steps={C.DRAFTER_STEPS}", f"train.data_paths={own}"]
        cfgs[w[name]] = override_run_config(DrafterRunConfig(), C.DRAFTER_COMMON + sets + extra)
    # one frozen-target pass per step for all of them: the target costs more than a drafter
    for result in train_drafters(cfgs, w["target"]).values():
        _finished(result)
    return w


# ----------------------------------------------------------------------------- costs
def cost_study(w: dict, target, drafters: dict, batches: tuple[int, ...]) -> tuple[dict, dict]:
    """(cost tables {name: {batch: CostTable}}, their reading {name: {batch: {c, v, ...}}}):
    c = the drafter pass, v(L) = the rest of a round that verifies L drafts, both in plain
    rounds (the table's width-0 entry); ceiling(L) = tau(L) / (c + v(L)) with tau from the
    drafter's fixed-K acceptance (filled in by `ceilings`)."""
    tables, units = {}, {}
    tp, tcfg = target.params, target.cfg.model
    scheduled = {name for _, name, mode in C.DECODERS if mode == "scheduled"}
    for name, (run_cfg, params, _) in drafters.items():
        for b in batches:
            if name not in scheduled and b not in C.COSTS_OF_EVERY_DRAFTER_AT:
                continue
            cost = load_or_measure_cost(
                w[name], tp, tcfg, params, run_cfg.drafter, b,
                rounds=C.COST_ROUNDS, passes=C.COST_PASSES,
            )  # fmt: skip
            draft = load_or_measure_draft_cost(w[name], tp, tcfg, params, run_cfg.drafter, b)
            plain = cost.seconds[0]
            tables.setdefault(name, {})[b] = cost
            units.setdefault(name, {})[b] = {
                "plain_round_s": plain,
                "draft_s": draft,
                "c": draft / plain,
                "v": [(s - draft) / plain for s in cost.seconds[1:]],
                "round": [s / plain for s in cost.seconds],
            }
    return tables, units


def ceilings(units: dict, stats: dict) -> None:
    """Add ceiling(L) = tau(L) / (c + v(L)) to every cost reading, tau(L) = 1 + sum_{j<=L}
    prod_{i<=j} alpha_i from the drafter's measured acceptance."""
    for name, by_b in units.items():
        alpha = [a or 0.0 for a in stats[name]["acceptance"]]
        tau = 1 + np.cumsum(np.cumprod(alpha))
        for u in by_b.values():
            u["ceiling"] = [float(t / (u["c"] + v)) for t, v in zip(tau, u["v"], strict=True)]


def _settings() -> dict:
    """The experiment's settings: every upper-case name of config.py (QUICK applied)."""
    return {n: getattr(C, n) for n in dir(C) if n.isupper() and n != "QUICK"}


def _plain(x):
    """numpy scalars and arrays as JSON numbers and lists (anything else as its text)."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


class _Stages:
    """The finished parts of the measurement, kept in a JSON file (written atomically after
    each part) together with the settings they were measured under: a rerun with other
    settings starts afresh instead of mixing results."""

    def __init__(self, path: str):
        self.path = path
        self.key = json.loads(json.dumps(_settings(), default=_plain))
        self.parts: dict = {}
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            if saved.get("settings") == self.key:
                self.parts = saved["parts"]

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def __getitem__(self, name: str):
        return self.parts[name]

    def put(self, name: str, value):
        self.parts[name] = json.loads(json.dumps(value, default=_plain))
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"settings": self.key, "parts": self.parts}, f)
        os.replace(tmp, self.path)
        return self.parts[name]


# ----------------------------------------------------------------------------- decoding
def decoders_at(target, batch: int) -> Decoder:
    prompts = val_prompts(target, C.PROMPTS[batch], C.PROMPT_LEN)
    return Decoder(target, prompts, C.NEW_TOKENS, C.SEED)


def _decode(dec: Decoder, batch: int, drafter, kw: dict | None, first: bool):
    """One timed pass (`time_interleaved`'s job): (seconds, merged log or None)."""
    return dec.run(batch, drafter, compile_first=first, **(kw or {}))


def acceptance_study(target, drafters: dict) -> dict:
    """Fixed-K statistics of every drafter at batch 32 (or the largest), temperature 1."""
    b = 32 if 32 in C.BATCHES else max(C.BATCHES)
    dec = decoders_at(target, b)
    out = {}
    for name, (run_cfg, params, _) in drafters.items():
        _, log = dec.run(b, (run_cfg, params), temperature=1.0)
        out[name] = drafter_stats(log, run_cfg.drafter.block_size)
    return out


def wall_clock(target, drafters: dict, tables: dict, done: _Stages, batches) -> list[dict]:
    """Every decoder at every batch of `batches` and temperature, TIMING_PASSES interleaved
    passes per batch size. speedup_vs_plain compares fastest passes (and medians) of the same
    run."""
    rows = []
    for b in batches:
        if f"wall_clock_b{b}" in done:
            rows += done[f"wall_clock_b{b}"]
            continue
        dec, jobs = decoders_at(target, b), {}
        for temp in C.TEMPERATURES:
            for label, name, mode in C.DECODERS:
                d = None if name is None else drafters[name][:2]
                kw = {"temperature": temp}
                if mode is not None:
                    kw["mode"] = mode
                if mode == "scheduled":
                    kw["cost"] = tables[name][b]
                jobs[(label, temp)] = functools.partial(_decode, dec, b, d, kw)
        timed = time_interleaved(jobs, C.TIMING_PASSES, desc=f"wall clock, batch {b}")
        total = len(dec.prompts) * C.NEW_TOKENS
        mine = []
        for (label, temp), t in timed.items():
            base = timed[("plain", temp)]
            log = t["payload"]
            mine.append({
                "decoder": label, "batch": b, "temperature": temp,
                "tokens_per_s": total / t["fastest"],
                "tokens_per_s_median": total / t["median"],
                "speedup_vs_plain": base["fastest"] / t["fastest"],
                "speedup_vs_plain_median": base["median"] / t["median"],
                "tokens_per_round": (
                    None if log is None else A.tokens_per_round(log["accepted"], log["active"])
                ),
                "mean_verify_len": (
                    None if log is None else float(log["verify_len"][log["active"]].mean())
                ),
                "passes_s": t["seconds"],
            })  # fmt: skip
        rows += done.put(f"wall_clock_b{b}", mine)
    return rows


def scheduler_study(target, drafter, tables: dict, done: _Stages) -> dict:
    """Per batch of SCHED_BATCHES: plain, fixed L = 1..K and scheduled, interleaved; then
    the replay of REPLAY_PASSES fixed-K decodes: every fixed L, the scheduler, width 0 and
    the oracle bound priced on the same rounds."""
    run_cfg, params = drafter[:2]
    k, out = run_cfg.drafter.block_size, {}
    for b in C.SCHED_BATCHES:
        if f"scheduler_b{b}" in done:
            out[str(b)] = done[f"scheduler_b{b}"]
            continue
        dec, cost = decoders_at(target, b), tables[b]
        configs = {"plain": None, "scheduled": dict(mode="scheduled", cost=cost)}
        configs.update({f"fixed L={L}": dict(verify_len=L) for L in range(1, k + 1)})
        jobs = {
            n: functools.partial(_decode, dec, b, None if kw is None else (run_cfg, params), kw)
            for n, kw in configs.items()
        }
        timed = time_interleaved(jobs, C.SCHED_PASSES, desc=f"scheduler, batch {b}")
        total = len(dec.prompts) * C.NEW_TOKENS
        res = {}
        for n, t in timed.items():
            log = t["payload"]
            res[n] = {
                "tokens_per_s": total / t["fastest"],
                "tokens_per_s_median": total / t["median"],
                "mean_verify_len": (
                    None if log is None else float(log["verify_len"][log["active"]].mean())
                ),
            }
        logs = [
            dec.run(b, (run_cfg, params), compile_first=False, seed=C.SEED + i)[1]
            for i in range(C.REPLAY_PASSES)
        ]
        replay = replay_policies(**stack_rounds(_by_batch(logs, b)), cost=cost)
        study = {"cost_table": cost.to_dict(), "configs": res, "replay": replay}
        out[str(b)] = done.put(f"scheduler_b{b}", study)
    return out


def _by_batch(logs: list[dict], b: int) -> list[dict]:
    """A merged log of one pass holds its chunks side by side: split back into [R, b] logs
    (the replay stacks rounds of one batch size)."""
    out = []
    for log in logs:
        width = log["active"].shape[1]
        out += [{k: v[:, i : i + b] for k, v in log.items() if v.ndim >= 2}
                for i in range(0, width, b)]  # fmt: skip
    return out


def evaluate_all(w: dict, out_dir: str) -> dict:
    """Every study; each finished part is kept in <out_dir>/stages.json, so a rerun after an
    interruption measures only what is missing (the cost tables are kept in the drafters'
    workdirs)."""
    done = _Stages(os.path.join(out_dir, "stages.json"))
    target = load_run(w["target"])
    drafters = {name: load_drafter(w[name]) for name in C.DRAFTERS}
    if "stats" not in done:
        done.put("stats", acceptance_study(target, drafters))
    stats = done["stats"]
    tables, units, rows = {}, {}, []
    for b in C.BATCHES:  # batch by batch: the costs, then the decoders that use them
        t, u = cost_study(w, target, drafters, (b,))
        for name in t:
            tables.setdefault(name, {}).update(t[name])
            units.setdefault(name, {}).update(u[name])
        rows += wall_clock(target, drafters, tables, done, (b,))
    ceilings(units, stats)
    sched = scheduler_study(target, drafters[C.MAIN], tables[C.MAIN], done)
    return {
        "costs": {n: {str(b): t.to_dict() for b, t in by.items()} for n, by in tables.items()},
        "cost_units": {n: {str(b): u for b, u in by.items()} for n, by in units.items()},
        "stats": stats,
        "wall_clock": rows,
        "scheduler_study": sched,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", help="default runs/dspark_deep (runs/dspark_deep_quick)")
    p.add_argument("--out-dir", help="default results/ here (with --quick <runs-dir>/results)")
    p.add_argument("--stage", choices=("all", "train"), default="all")
    p.add_argument("--quick", action="store_true", help="a miniature of everything (tests)")
    args = p.parse_args(argv)
    setting = "quick" if args.quick else "full"
    runs_dir, out_dir = experiment_dirs(HERE, setting, args.runs_dir, args.out_dir)
    if args.quick:
        for name, value in C.QUICK.items():
            setattr(C, name, value)
    w = train_all(runs_dir)
    if args.stage == "train":
        return 0
    os.makedirs(out_dir, exist_ok=True)
    summary = {
        "setting": setting,
        "machine": machine_info(),
        "settings": _settings(),
        "training": {n: json.load(open(os.path.join(w[n], "eval.json"))) for n in w},
        **evaluate_all(w, out_dir),
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=_plain)
    print(write_report(summary, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
