"""Regenerate the speculative-decoding throughput experiment: Monte Carlo, then a real run.

    python experiments/spec_throughput/run.py [--runs-dir runs/spec_throughput] [--quick]

1. Monte Carlo: for each (alpha, k), p and q tables with sum_x min(p, q) = alpha exactly at
   every position, drafts drawn from q, the real jitted `speculative_sample`; measured mean
   tokens per round against `expected_tokens_per_round(alpha, k)`, with its standard error.
2. Real run: trains (or resumes) the `small` target and a much smaller drafter on the same
   corpus, then decodes validation-split prompts with `speculative_generate` and with plain
   KV-cache `generate`: per-position acceptance, tokens per round, wall-clock speedup, and
   the model's prediction from the measured acceptance and measured step costs.
Writes `results/summary.json`, `results/tokens_per_round.png`, `results/real_run.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
from v41jax.sweep import experiment_module  # noqa: E402

C = experiment_module(HERE, "config")

from v41jax.bench.common import time_call  # noqa: E402
from v41jax.data import load_data  # noqa: E402
from v41jax.decode import SamplingParams, generate, sampling_probs, speculative_generate  # noqa: E402
from v41jax.decode.engine import extend_output  # noqa: E402
from v41jax.decode.generate import init_cache  # noqa: E402
from v41jax.speculative import (  # noqa: E402
    expected_tokens_per_round,
    speculative_sample,
    walltime_speedup_measured,
)
from v41jax.sweep import experiment_dirs  # noqa: E402
from v41jax.train import load_run, train  # noqa: E402


# ----------------------------------------------------------------------------- Monte Carlo
def controlled_tables(alpha: float, k: int, v: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """p [k+1, v], q [k, v] with sum min(p_j, q_j) = alpha: p = alpha c + (1-alpha) a,
    q = alpha c + (1-alpha) b, where a and b live on disjoint halves of the vocabulary."""
    half = v // 2
    p, q = [], []
    for _ in range(k + 1):
        c = rng.dirichlet(np.ones(v))
        a = np.zeros(v)
        a[:half] = rng.dirichlet(np.ones(half))
        b = np.zeros(v)
        b[half:] = rng.dirichlet(np.ones(v - half))
        p.append(alpha * c + (1 - alpha) * a)
        q.append(alpha * c + (1 - alpha) * b)
    return np.array(p, np.float32), np.array(q[:k], np.float32)


def monte_carlo(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    sample = jax.jit(lambda key, d, q, p: speculative_sample(key, d, q, p))
    rows = []
    grid = [(a, k) for a in C.ALPHAS for k in C.DRAFT_LENGTHS]
    for i, (alpha, k) in enumerate(tqdm(grid, desc="monte carlo")):
        p, q = controlled_tables(alpha, k, C.MC_VOCAB, rng)
        n = C.MC_ROWS
        drafts = np.stack(
            [rng.choice(C.MC_VOCAB, size=n, p=q[j] / q[j].sum()) for j in range(k)], axis=1
        )
        _, accepted = sample(
            jax.random.key(seed * 1000 + i),
            jnp.asarray(drafts, jnp.int32),
            jnp.broadcast_to(q, (n, k, C.MC_VOCAB)),
            jnp.broadcast_to(p, (n, k + 1, C.MC_VOCAB)),
        )
        tokens = np.asarray(accepted, np.float64) + 1
        beta = np.minimum(p[:k], q).sum(axis=1)
        model = expected_tokens_per_round(float(alpha), k)
        sem = tokens.std(ddof=1) / np.sqrt(n)
        rows.append(
            {
                "alpha": alpha,
                "k": k,
                "rows": n,
                "measured": float(tokens.mean()),
                "sem": float(sem),
                "model": model,
                "z": float((tokens.mean() - model) / sem) if sem > 0 else 0.0,
                "beta_max_error": float(np.abs(beta - alpha).max()),
            }
        )
    return rows


def plot_monte_carlo(rows: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for alpha in C.ALPHAS:
        ks = np.arange(0, max(C.DRAFT_LENGTHS) + 1)
        line = ax.plot(ks, [expected_tokens_per_round(alpha, int(k)) for k in ks], lw=1)
        pts = [r for r in rows if r["alpha"] == alpha]
        ax.errorbar(
            [r["k"] for r in pts],
            [r["measured"] for r in pts],
            yerr=[3 * r["sem"] for r in pts],
            fmt="o",
            ms=3,
            color=line[0].get_color(),
            label=f"alpha={alpha}",
        )
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tokens per round")
    ax.set_title("model (lines) vs measured (points, 3 s.e.)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- real run
def _median_seconds(fn, repeats: int) -> float:
    return time_call(fn, warmup=1, iters=repeats)["median_s"]


def step_costs(run, b: int, t_max: int, temperature: float, repeats: int, steps: int = 8):
    """Seconds of one cached forward over t tokens plus the sampling distribution, t = 1..t_max
    (one draft step is t = 1, one verify pass t = K + 1). Measured as `steps` calls in a
    `lax.scan` that carries the cache, as decoding does: a standalone call would also copy
    the whole KV cache, which the decoding loops update in place."""
    cfg = run.cfg.model
    kv = init_cache(cfg, b)
    history = jnp.ones((b, cfg.max_seq_len), jnp.int32)
    out = {}
    for t in range(1, t_max + 1):

        @functools.partial(jax.jit, static_argnums=0)
        def loop(t, params, kv, history):
            def body(kv, i):
                start = jnp.full((b,), 64, jnp.int32) + i * t
                out = extend_output(params, cfg, kv, history, start, t)
                logits, kv = out.logits.astype(jnp.float32), out.cache
                return kv, sampling_probs(logits, SamplingParams(temperature))[:, 0, 0]

            return jax.lax.scan(body, kv, jnp.arange(steps))[1]

        total = _median_seconds(lambda t=t: loop(t, run.params, kv, history), repeats)
        out[t] = total / steps
    return out


def val_prompts(run, n: int, length: int) -> np.ndarray:
    data = load_data(run.cfg.data, tokenizer=run.tokenizer)
    tokens = np.asarray(data.val_tokens)
    starts = np.linspace(0, tokens.size - length - 1, n).astype(int)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def real_run(runs_dir: str, steps: int | None) -> dict:
    results = {}
    workdirs = {}
    for role, cfg in (("target", C.target_config()), ("drafter", C.drafter_config())):
        if steps is not None:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        workdirs[role] = os.path.join(runs_dir, role)
        results[f"{role}_eval"] = train(cfg, workdirs[role])
    target, drafter = load_run(workdirs["target"]), load_run(workdirs["drafter"])
    with open(os.path.join(workdirs["target"], "tokenizer.json")) as f_t:
        with open(os.path.join(workdirs["drafter"], "tokenizer.json")) as f_d:
            if f_t.read() != f_d.read():
                raise RuntimeError("target and drafter were trained with different tokenizers")
    prompts = val_prompts(target, C.NUM_PROMPTS, C.PROMPT_LEN)
    b = prompts.shape[0]
    lengths = np.full((b,), C.PROMPT_LEN, np.int32)
    t_max = max(C.REAL_DRAFT_LENGTHS) + 1
    rows = []
    for temperature in C.TEMPERATURES:
        costs_t = step_costs(target, b, t_max, temperature, C.TIMING_REPEATS)
        costs_d = step_costs(drafter, b, 1, temperature, C.TIMING_REPEATS)
        common = dict(max_new_tokens=C.NEW_TOKENS, sampling=SamplingParams(temperature))

        def plain(common=common):
            return generate(target.params, target.cfg.model, prompts, lengths, **common)

        plain_s = _median_seconds(plain, C.TIMING_REPEATS)
        for k in tqdm(C.REAL_DRAFT_LENGTHS, desc=f"real run T={temperature}"):

            def spec(k=k, common=common):
                return speculative_generate(
                    target.params,
                    target.cfg.model,
                    drafter.params,
                    drafter.cfg.model,
                    prompts,
                    lengths,
                    num_draft=k,
                    rng=jax.random.key(1),
                    **common,
                )

            spec_s = _median_seconds(spec, C.TIMING_REPEATS)
            out = spec()
            counts = np.asarray(out.accepted_counts).sum(axis=0).astype(np.float64)
            survival = counts[::-1].cumsum()[::-1]  # rounds with A >= j, j = 0..k
            rates = survival[1:] / np.maximum(survival[:-1], 1)
            measured_tpr = float((counts * np.arange(k + 1)).sum() / counts.sum() + 1)
            predicted = walltime_speedup_measured(
                rates,
                k,
                costs_d[1],
                list(costs_t),
                list(costs_t.values()),
            )
            # Rows run in lockstep: the loop runs as many rounds as the slowest row needs.
            per_row = np.asarray(out.rounds, np.float64)
            lockstep = float(per_row.mean() / per_row.max())
            round_model_s = k * costs_d[1] + costs_t[k + 1]
            rows.append(
                {
                    "temperature": temperature,
                    "k": k,
                    "rounds": int(counts.sum()),
                    "rounds_max": int(per_row.max()),
                    "rounds_mean": float(per_row.mean()),
                    "lockstep_efficiency": lockstep,
                    "speedup_predicted_lockstep": predicted * lockstep,
                    "round_s_model": round_model_s,
                    "round_s_measured": spec_s / per_row.max(),
                    "acceptance_per_position": rates.tolist(),
                    "tokens_per_round": measured_tpr,
                    "tokens_per_round_model": expected_tokens_per_round(rates, k),
                    "plain_s": plain_s,
                    "spec_s": spec_s,
                    "speedup_measured": plain_s / spec_s,
                    "speedup_predicted": predicted,
                    "cost_ratio": costs_d[1] / costs_t[1],
                    "target_step_s": costs_t,
                    "drafter_step_s": costs_d[1],
                }
            )
    results["rows"] = rows
    results["setup"] = {
        "prompts": b,
        "prompt_len": C.PROMPT_LEN,
        "new_tokens": C.NEW_TOKENS,
        "target_params": int(sum(x.size for x in jax.tree.leaves(target.params))),
        "drafter_params": int(sum(x.size for x in jax.tree.leaves(drafter.params))),
    }
    return results


def plot_real(rows: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature in sorted({r["temperature"] for r in rows}):
        pts = [r for r in rows if r["temperature"] == temperature]
        ks = [r["k"] for r in pts]
        line = ax.plot(
            ks, [r["speedup_predicted"] for r in pts], "--", label=f"model T={temperature}"
        )
        ax.plot(
            ks,
            [r["speedup_measured"] for r in pts],
            "o-",
            color=line[0].get_color(),
            label=f"measured T={temperature}",
        )
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("wall-clock speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs-dir", help="default: runs/spec_throughput (_quick with --quick)")
    p.add_argument(
        "--out-dir",
        help="default: results/ next to this file; with --quick <runs-dir>/results, so a "
        "miniature never overwrites the committed results",
    )
    p.add_argument("--quick", action="store_true", help="a miniature of everything (tests)")
    args = p.parse_args()
    setting = "quick" if args.quick else "full"
    args.runs_dir, args.out_dir = experiment_dirs(HERE, setting, args.runs_dir, args.out_dir)
    steps = None
    if args.quick:
        quick = dict(C.QUICK)
        steps = quick.pop("TRAIN_STEPS")
        for name, value in quick.items():
            setattr(C, name, value)
    os.makedirs(args.out_dir, exist_ok=True)
    mc = monte_carlo()
    plot_monte_carlo(mc, os.path.join(args.out_dir, "tokens_per_round.png"))
    print(f"{'alpha':>6} {'k':>2} {'measured':>9} {'model':>7} {'z':>6}")
    for r in mc:
        print(f"{r['alpha']:6.2f} {r['k']:2d} {r['measured']:9.4f} {r['model']:7.4f} {r['z']:6.2f}")
    real = real_run(args.runs_dir, steps)
    plot_real(real["rows"], os.path.join(args.out_dir, "real_run.png"))
    print(
        f"{'T':>4} {'k':>2} {'acc/pos':>28} {'tok/rnd':>7} {'model':>6} {'speedup':>8} "
        f"{'predicted':>9} {'lockstep':>8} {'pred*lock':>9} {'ms/rnd':>6} {'model':>6}"
    )
    for r in real["rows"]:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(
            f"{r['temperature']:4.1f} {r['k']:2d} {acc:>28} {r['tokens_per_round']:7.3f} "
            f"{r['tokens_per_round_model']:6.3f} {r['speedup_measured']:8.3f} "
            f"{r['speedup_predicted']:9.3f} {r['lockstep_efficiency']:8.3f} "
            f"{r['speedup_predicted_lockstep']:9.3f} {1e3 * r['round_s_measured']:6.2f} "
            f"{1e3 * r['round_s_model']:6.2f}"
        )
    summary = {
        "setting": setting,
        "monte_carlo": mc,
        "real": real,
        "machine": jax.devices()[0].device_kind,
    }
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
