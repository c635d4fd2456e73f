"""DSpark under load: continuous batching at rising concurrency, plain vs fixed lengths vs the
scheduler on the padded and the ragged engine.

    python experiments/dspark_load/run.py [--runs-dir D] [--out-dir R] [--stage all|train]
                                          [--quick]

1. Train what is missing (resumable): `experiments/dspark_deep`'s target, its own text and
   its main drafter (`dspark`), in dspark_deep's runs dir by default, so either experiment
   reuses the other's finished runs.
2. Per concurrency c of config.CONCURRENCY: the round-cost tables at batch c (padded widths
   0..K and ragged packed sizes; saved in the drafter's workdir), then closed-loop decoding:
   c requests always in flight (a new one submitted as each finishes) through
   `ContinuousBatcher(slots=c)` (caches of config.CONTEXT_LEN slots), measured over the
   config.REQUESTS[c] requests (config.NEW_TOKENS tokens at config.TEMPERATURE) that finish
   after the first c (the steady state; `closed_loop`), for every decoder of
   config.DECODERS. Each decoder first compiles every program a run can reach
   (`ContinuousBatcher.precompile`), then config.PASSES timed
   passes, the decoders interleaved in an order that alternates between passes; a timed
   run that still compiled is run again (`timed_run`).
3. Open loop: Poisson arrivals into config.OPEN_SLOTS slots at config.OPEN_RATES times plain
   decoding's closed-loop request rate there.
Every finished part is kept in <out-dir>/stages.json (a rerun measures only what is missing);
writes results/summary.json (`summary["load"]`: one row per decoder and concurrency, its
fastest pass), results/tables.md and the PNGs (report.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEEP = os.path.join(os.path.dirname(HERE), "dspark_deep")
from v41jax.sweep import experiment_module, git_commit  # noqa: E402

C = experiment_module(HERE, "config")
D = experiment_module(DEEP, "config")
report = experiment_module(HERE, "report")

from v41jax.bench.common import CompileCounter, machine_info  # noqa: E402
from v41jax.data.corpus import split_speeches_by_year  # noqa: E402
from v41jax.decode.batching import ContinuousBatcher, PlainProposer, Request  # noqa: E402
from v41jax.decode.engine import packed_buckets  # noqa: E402
from v41jax.decode.gate import SpeculationGate  # noqa: E402
from v41jax.decode.generate import with_context_len  # noqa: E402
from v41jax.decode.sampling import SamplingParams  # noqa: E402
from v41jax.dspark.analysis.study import val_prompts  # noqa: E402
from v41jax.dspark.decode.engine import admission_for, load_or_measure_cost  # noqa: E402
from v41jax.dspark.decode.rounds import DSparkProposer, ScheduledLengths, ScheduledWidth  # noqa: E402
from v41jax.dspark.decode.scheduler import CostTable, RaggedCost  # noqa: E402
from v41jax.dspark.model.drafter import frozen_target  # noqa: E402
from v41jax.dspark.train.config import DrafterRunConfig, override_run_config  # noqa: E402
from v41jax.dspark.train.load import load_drafter  # noqa: E402
from v41jax.dspark.train.loop import train_drafters  # noqa: E402
from v41jax.dspark.train.self_text import write_target_samples  # noqa: E402
from v41jax.sweep import experiment_dirs  # noqa: E402
from v41jax.train import load_run, train  # noqa: E402


def _finished(result: dict) -> None:
    if result.get("stopped"):  # it checkpointed; later stages build on it
        sys.exit("stopped by a signal; rerun the same command to continue")


def train_needed(runs_dir: str) -> dict:
    """dspark_deep's target, its own text and its main drafter (trained if missing)."""
    early, _ = split_speeches_by_year(os.path.join(runs_dir, "texts"), D.SPLIT_YEAR)
    w = {"target": os.path.join(runs_dir, "target")}
    _finished(train(D.target_config(early), w["target"]))
    own = os.path.join(runs_dir, "texts", "target_samples")
    write_target_samples(load_run(w["target"]), own, **D.SELF_TEXT)
    w["drafter"] = os.path.join(runs_dir, "drafters", D.MAIN)
    sets = D.DRAFTER_COMMON + D.DRAFTERS[D.MAIN]
    sets += [f"train.steps={D.DRAFTER_STEPS}", f"train.data_paths={own}"]
    cfg = override_run_config(DrafterRunConfig(), sets)
    for result in train_drafters({w["drafter"]: cfg}, w["target"]).values():
        _finished(result)
    return w


# ----------------------------------------------------------------------------- costs
def ragged_sizes(b: int, k: int, n: int) -> tuple[int, ...]:
    """The packed sizes timed at batch b: every bucket up to 8, then n of the others spread
    evenly in log (the largest, B (1 + K), always); the scheduler interpolates between them."""
    buckets = [x for x in packed_buckets(b, k) if x >= 2]
    small, rest = [x for x in buckets if x <= 8], [x for x in buckets if x > 8]
    if len(rest) > n:
        rest = [rest[i] for i in np.unique(np.round(np.linspace(0, len(rest) - 1, n)).astype(int))]
    return tuple(small + rest)


def costs_at(w: dict, target, drafter, c: int) -> dict:
    """{"padded": CostTable, "ragged": RaggedCost} at batch c (measured once, kept in the
    drafter's workdir)."""
    run_cfg, params, _ = drafter
    dcfg, tp, tcfg = run_cfg.drafter, target.params, serving_cfg(target)
    kw = dict(rounds=C.COST_ROUNDS, passes=C.COST_PASSES)
    padded = load_or_measure_cost(w["drafter"], tp, tcfg, params, dcfg, c, **kw)
    sizes = ragged_sizes(c, dcfg.block_size, C.RAGGED_SIZES)
    ragged = load_or_measure_cost(
        w["drafter"], tp, tcfg, params, dcfg, c, verify="ragged", sizes=sizes, **kw
    )
    return {"padded": padded, "ragged": ragged}


# ----------------------------------------------------------------------------- decoding
def serving_cfg(target):
    """The target's config with config.CONTEXT_LEN cache slots per row (the parameters are
    the same): the batchers and the cost tables decode with it."""
    return with_context_len(target.cfg.model, C.CONTEXT_LEN)


def make_batcher(name: str, slots: int, target, drafter, costs: dict) -> ContinuousBatcher:
    tp, tcfg = target.params, serving_cfg(target)
    common = dict(slots=slots, compression=target.compression.table, rng=jax.random.key(C.SEED))
    if name == "plain":
        return ContinuousBatcher(tp, tcfg, None, PlainProposer(tcfg.vocab_size), policy=0, **common)
    run_cfg, params, _ = drafter
    dcfg = run_cfg.drafter
    proposer, dparams = DSparkProposer(dcfg, tcfg), (params, frozen_target(tp, tcfg))
    verify, buckets = "padded", ()
    if name.startswith("fixed_L"):
        policy = int(name.removeprefix("fixed_L"))
    elif name == "scheduled_padded":
        policy = ScheduledWidth(costs["padded"], admission_for(dcfg))
    elif name == "scheduled_ragged":
        policy, verify = ScheduledLengths(costs["ragged"]), "ragged"
        buckets = costs["ragged"].buckets
    else:
        raise ValueError(f"unknown decoder {name!r}; known: {C.DECODERS}")
    # the scheduler reads the loop's measured throughput too; the fixed lengths are baselines
    gate = None
    if name.startswith("scheduled") and C.SPECULATION_GATE is not None:
        gate = SpeculationGate(**C.SPECULATION_GATE)
    return ContinuousBatcher(
        tp, tcfg, dparams, proposer, policy=policy, verify=verify, buckets=buckets, gate=gate,
        **common,
    )  # fmt: skip


def _requests(prompts: np.ndarray, n: int, first_id: int = 0) -> list[Request]:
    sampling = SamplingParams(C.TEMPERATURE)
    return [
        Request(prompts[i % len(prompts)].tolist(), C.NEW_TOKENS, sampling, request_id=first_id + i)
        for i in range(n)
    ]


COMPILE_RETRIES = 2  # a timed run that compiled is run again, at most this many times


def timed_run(measure) -> dict:
    """`measure()` again while it compiled (up to COMPILE_RETRIES more times: each run
    compiles what it meets, so a rerun meets less); the last run, with "compiles" (how many
    programs it compiled, 0 unless the retries ran out) and "reruns"."""
    reruns = 0
    while True:
        with CompileCounter() as compiled:
            res = measure()
        if not compiled.count or reruns == COMPILE_RETRIES:
            return res | {"compiles": compiled.count, "reruns": reruns}
        reruns += 1


def closed_loop(batcher: ContinuousBatcher, prompts, n: int, c: int) -> dict:
    """c requests always in flight (a new one submitted as each finishes), measured in the
    steady state: over the n requests that finish after the first c (the batch starts empty
    and its first wave finishes together), from the c-th completion to the last. The c
    still in flight then are cancelled: a run that let the batch drain would decode its end
    at falling concurrency."""
    pending = iter(_requests(prompts, n + 3 * c))  # a step can finish up to c at once
    for _ in range(c):
        batcher.submit(next(pending))
    done = []
    while len(done) < c + n:
        finished = batcher.step()
        done += finished
        for _ in finished:
            batcher.submit(next(pending))
    batcher.cancel()
    return steady_state(done, c, n)


def steady_state(done: list, c: int, n: int) -> dict:
    """`measured` over completions c .. c + n - 1 (completion order), the window from the
    c-th completion's finish to the last one's."""
    window = done[c : c + n]
    return measured(window, window[-1].finished_s - done[c - 1].finished_s)


def open_loop(batcher: ContinuousBatcher, prompts, n: int, rate: float, seed: int) -> dict:
    """n requests arriving as a Poisson process of `rate` per second; latency from arrival."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
    requests, i, done = _requests(prompts, n), 0, []
    start = time.perf_counter()
    while len(done) < n:
        now = time.perf_counter() - start
        while i < n and arrivals[i] <= now:
            batcher.submit(requests[i], submitted_s=start + arrivals[i])
            i += 1
        if batcher.busy or batcher.waiting:
            done += batcher.step()
        elif i < n:
            time.sleep(max(0.0, arrivals[i] - now))
    return measured(done, max(x.finished_s for x in done) - start)


def measured(done: list, wall_s: float) -> dict:
    """One run's numbers: output tokens/s, per-request latency p50 / p99, mean verify length
    (drafts verified per round a request took part in)."""
    latency = np.asarray([x.latency_s for x in done])
    tokens = sum(len(x.tokens) for x in done)
    rounds = sum(x.rounds for x in done)
    return {
        "requests": len(done),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "p50_latency_s": float(np.percentile(latency, 50)),
        "p99_latency_s": float(np.percentile(latency, 99)),
        "mean_verify_len": sum(x.drafted for x in done) / max(rounds, 1),
        "acceptance": sum(x.accepted for x in done) / max(sum(x.drafted for x in done), 1),
    }


def boot_id() -> str:
    """This machine's boot: parts of one group are measured within one (see Stages)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{os.uname().nodename}:{os.getpid()}"


def part_group(name: str) -> str:
    """The group a part belongs to: "closed/c4" for closed/c4/pass0/plain and costs/c4,
    "open" for open/0.5/plain and costs/open."""
    kind, rest = name.split("/", 1)
    if kind == "costs":
        return "open" if rest == "open" else f"closed/{rest}"
    return "open" if kind == "open" else f"{kind}/{rest.split('/', 1)[0]}"


class Stages:
    """Finished parts in a JSON file (written atomically after each) beside the settings they
    were measured under: a rerun with other settings starts afresh instead of mixing.

    Every part records the boot it was measured in. A group of parts compared with each other
    (one concurrency's cost tables and every decoder's passes; the open loop) is measured on
    one machine: on a rerun, the parts of a group that is not complete and was started on
    another boot are dropped (and named), so a benchmark that outlives its machine resumes
    group by group instead of pricing a decoder against a plain pass timed elsewhere."""

    def __init__(self, path: str, settings: dict, complete: dict | None = None):
        self.path, self.key, self.parts, self.boot = path, settings, {}, boot_id()
        if os.path.exists(path):
            try:
                with open(path) as f:
                    saved = json.load(f)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path} is damaged ({e}); move it away to start afresh") from e
            if saved.get("settings") == settings:
                self.parts = saved["parts"]
            else:
                print(f"{path}: measured under other settings; starting afresh", flush=True)
        self._drop_groups_started_elsewhere(complete or {})

    def _drop_groups_started_elsewhere(self, complete: dict) -> None:
        groups: dict[str, list[str]] = {}
        for name in self.parts:
            groups.setdefault(part_group(name), []).append(name)
        for group, names in groups.items():
            done = group in complete and set(complete[group]) <= set(names)
            boots = {self.parts[n].get("boot") for n in names}
            if not done and boots != {self.boot}:
                print(f"{self.path}: dropping {len(names)} parts of unfinished group {group} "
                      f"measured on another machine/boot", flush=True)  # fmt: skip
                for n in names:
                    del self.parts[n]

    def get(self, name: str, measure):
        if name not in self.parts:
            self.parts[name] = {**measure(), "boot": self.boot}
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"settings": self.key, "parts": self.parts}, f)
            os.replace(tmp, self.path)
        return self.parts[name]


def decoder_names(block_size: int) -> list[str]:
    """config.DECODERS less the fixed lengths the drafter cannot propose (L > K)."""
    return [n for n in C.DECODERS if not n.startswith("fixed_L") or int(n[7:]) <= block_size]


def expected_parts(names: list[str]) -> dict[str, list[str]]:
    """Every part of every group (Stages): a concurrency's cost tables and passes; the open
    loop's cost tables and runs."""
    groups = {
        f"closed/c{c}": [f"costs/c{c}"]
        + [f"closed/c{c}/pass{p}/{n}" for p in range(C.PASSES) for n in names]
        for c in C.CONCURRENCY
    }
    groups["open"] = ["costs/open"] + [f"open/{f}/{n}" for f in C.OPEN_RATES for n in names]
    return groups


def cost_part(w: dict, target, drafter, c: int) -> dict:
    """A group's cost tables as dicts, with the machine they were measured on."""
    cost = costs_at(w, target, drafter, c)
    jax.clear_caches()  # free the timing programs (see load_study)
    return {"padded": cost["padded"].to_dict(), "ragged": cost["ragged"].to_dict(),
            "machine": machine_info()}  # fmt: skip


def cost_tables(part: dict) -> dict:
    return {"padded": CostTable.from_dict(part["padded"]),
            "ragged": RaggedCost.from_dict(part["ragged"])}  # fmt: skip


def load_study(w: dict, target, drafter, stages: Stages) -> tuple[list, list, dict]:
    """(closed-loop rows of every pass, open-loop rows, cost tables by concurrency)."""
    names = decoder_names(drafter[0].drafter.block_size)
    prompts = val_prompts(target, max(C.REQUESTS.values()), C.PROMPT_LEN)
    rows, costs = [], {}
    for c in C.CONCURRENCY:
        # Every compiled program stays mapped in the process: the cost tables' and the
        # decoders' programs of c = 1 and part of c = 4 ran XLA CPU out of memory mappings
        # for code ("LLVM ERROR: Unable to allocate section memory", vm.max_map_count
        # 65530). A group needs only its own programs.
        jax.clear_caches()
        part = stages.get(f"costs/c{c}", lambda c=c: cost_part(w, target, drafter, c))
        costs[c] = {"padded": part["padded"], "ragged": part["ragged"]}
        cost, batchers = cost_tables(part), {}
        for p in range(C.PASSES):
            order = names if p % 2 == 0 else names[::-1]
            for name in order:
                key = f"closed/c{c}/pass{p}/{name}"
                if key in stages.parts:
                    rows.append(stages.parts[key])
                    continue
                if name not in batchers:
                    batchers[name] = make_batcher(name, c, target, drafter, cost)
                    if C.PRECOMPILE:
                        batchers[name].precompile([prompts.shape[1]])
                res = {"decoder": name, "concurrency": c, "pass": p}
                b = batchers[name]
                res |= timed_run(lambda b=b, c=c: closed_loop(b, prompts, C.REQUESTS[c], c))
                b.reset()  # its caches: 8 idle batchers at 256 slots ran the VM out of memory
                print(f"  c={c} pass {p} {name}: {res['tokens_per_s']:.1f} tokens/s"
                      + (f" ({res['reruns']} reruns: it compiled)" if res["reruns"] else ""),
                      flush=True)  # fmt: skip
                rows.append(stages.get(key, lambda res=res: res))
    plain = max(
        (r for r in rows if r["decoder"] == "plain" and r["concurrency"] == C.OPEN_SLOTS),
        key=lambda r: r["tokens_per_s"],
    )
    jax.clear_caches()
    part = stages.get("costs/open", lambda: cost_part(w, target, drafter, C.OPEN_SLOTS))
    open_rows, cost = [], cost_tables(part)
    for j, frac in enumerate(C.OPEN_RATES):
        rate = frac * plain["tokens_per_s"] / C.NEW_TOKENS  # requests per second
        for name in names:
            key = f"open/{frac}/{name}"

            def measure(name=name, rate=rate, frac=frac, j=j):
                b = make_batcher(name, C.OPEN_SLOTS, target, drafter, cost)
                if C.PRECOMPILE:
                    b.precompile([prompts.shape[1]])
                res = timed_run(lambda: open_loop(b, prompts, C.OPEN_REQUESTS, rate, C.SEED + j))
                return {"decoder": name, "rate_fraction": frac, "rate_per_s": rate} | res

            open_rows.append(stages.get(key, measure))
    return rows, open_rows, costs


def finished_groups(stages: Stages, complete: dict) -> tuple[list, list, dict, list]:
    """What the finished groups of `stages` hold, measuring nothing: (closed-loop rows of
    every pass, open-loop rows, cost tables by concurrency, the unfinished groups' names).
    A partial summary: each finished group was measured whole on one machine."""
    rows, open_rows, costs, missing = [], [], {}, []
    for group, names in complete.items():
        if not set(names) <= set(stages.parts):
            missing.append(group)
            continue
        for name in names:
            part = stages.parts[name]
            if name == "costs/open":
                continue
            if name.startswith("costs/"):
                costs[int(name.removeprefix("costs/c"))] = {
                    "padded": part["padded"],
                    "ragged": part["ragged"],
                }
            elif group == "open":
                open_rows.append(part)
            else:
                rows.append(part)
    return rows, open_rows, costs, missing


def best_passes(rows: list[dict]) -> list[dict]:
    """summary["load"]: per decoder and concurrency its fastest pass, with speedup_vs_plain
    against plain's fastest pass at that concurrency."""
    best = {}
    for r in rows:
        key = (r["decoder"], r["concurrency"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    out = []
    for (name, c), r in best.items():
        plain = best[("plain", c)]["tokens_per_s"]
        fields = ("tokens_per_s", "p50_latency_s", "p99_latency_s", "mean_verify_len")
        out.append({"decoder": name, "concurrency": c, **{f: r[f] for f in fields},
                    "speedup_vs_plain": r["tokens_per_s"] / plain,
                    "acceptance": r["acceptance"]})  # fmt: skip
    return sorted(out, key=lambda r: (r["concurrency"], C.DECODERS.index(r["decoder"])))


def params_fingerprint(tree) -> str:
    """sha256 of a parameter tree's leaves (paths, dtypes, shapes, bytes): the models a
    stages file was measured with, so a retrained model that differs starts afresh."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def settings(target=None, drafter=None) -> dict:
    """This experiment's settings, dspark_deep's that define the models, and (given them)
    the fingerprints of the models' parameters."""
    mine = {n: getattr(C, n) for n in dir(C) if n.isupper() and n != "QUICK"}
    deep = {n: getattr(D, n) for n in ("TARGET", "TARGET_STEPS", "SELF_TEXT", "DRAFTER_STEPS")}
    out = {**mine, "dspark_deep": deep}
    if target is not None:
        out["models"] = {"target": params_fingerprint(target.params),
                         "drafter": params_fingerprint(drafter[1])}  # fmt: skip
    return json.loads(json.dumps(out, default=str))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", help="the models: default dspark_deep's (runs/dspark_deep)")
    p.add_argument("--out-dir", help="default results/ here (--quick: runs/dspark_load_quick)")
    p.add_argument("--stage", choices=("all", "train"), default="all")
    p.add_argument("--quick", action="store_true", help="a miniature of everything (tests)")
    p.add_argument("--finished-only", action="store_true",
                   help="measure nothing: summarise the finished groups of stages.json, "
                        "naming the missing ones (a partial summary)")  # fmt: skip
    args = p.parse_args(argv)
    setting = "quick" if args.quick else "full"
    if args.quick:
        for name, value in C.QUICK.items():
            setattr(C, name, value)
        for name, value in D.QUICK.items():
            setattr(D, name, value)
    runs_dir = args.runs_dir or experiment_dirs(DEEP, setting)[0]
    out_dir = args.out_dir or experiment_dirs(HERE, setting)[1]
    w = train_needed(runs_dir)
    if args.stage == "train":
        return 0
    os.makedirs(out_dir, exist_ok=True)
    target, drafter = load_run(w["target"]), load_drafter(w["drafter"])
    complete = expected_parts(decoder_names(drafter[0].drafter.block_size))
    key = settings(target, drafter)
    stages = Stages(os.path.join(out_dir, "stages.json"), key, complete)
    if args.finished_only:
        rows, open_rows, costs, missing = finished_groups(stages, complete)
        if not rows:
            sys.exit(f"{stages.path}: no finished group to summarise (missing {missing})")
    else:
        (rows, open_rows, costs), missing = load_study(w, target, drafter, stages), []
    summary = {
        "setting": setting,
        "machine": machine_info(),
        "commit": git_commit(HERE),
        "settings": key,
        "drafter": {"block_size": drafter[0].drafter.block_size, "workdir": w["drafter"]},
        "load": best_passes(rows),
        "passes": rows,
        "open_loop": open_rows,
        "costs": {str(c): v for c, v in costs.items()},
        "missing_groups": missing,
    }
    tmp = os.path.join(out_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "summary.json"))
    print(report.write_report(summary, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
