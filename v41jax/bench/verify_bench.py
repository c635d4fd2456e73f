"""Speculative verification speed: `speculative_sample` against the read-once bound.

For each (B, K, V) row, with random p [B, K+1, V] and q [B, K, V] (float32) and drafts drawn
from q, times (jitted, random numbers drawn inside, medians side by side in one run):
  bound      the read-once bound: bytes of p and q over this machine's read bandwidth,
             measured in the same run as a jitted full sum over p and q
  read_p     reading p once (a jitted full sum over p alone): the floor of any verifier
             that looks at every target probability, e.g. one-hot drafts
  xla        `speculative_sample(impl="xla")`: gathers p_j(d_j), q_j(d_j), then reads only
             the rows at the first rejection and draws one inverse-CDF uniform per row
  race_row   `speculative_sample(impl="reference")`: exponential race over the one residual
             row, with B V uniforms
  pallas     `speculative_sample(impl="pallas")`: the fused one-pass kernel; timed only on
             GPU/TPU (on CPU Pallas runs interpreted, which times the interpreter)
  common     the common approach: an exponential race over the full vocabulary of every
             drafted position (B (K+1) V exponentials), then pick the row of the first
             rejection
Ratios are time / bound time. Target: xla within 2x of the bound. The same code runs on
GPU/TPU (where "pallas" is timed compiled); `--quick` times B = 128, K = 7, V = 129,280
once (one round, 5 calls), well under a minute on an accelerator.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from v41jax.bench.common import format_table, machine_info, time_call, write_json
from v41jax.kernels.spec_verify.reference import (
    assemble_output,
    count_accepted,
    draft_token_probs,
)
from v41jax.speculative import speculative_sample


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=64, help="B")
    p.add_argument("--drafts", type=int, default=5, help="K")
    p.add_argument("--vocabs", default="32000,128000", help="comma list of V")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, best median kept")
    p.add_argument("--quick", action="store_true", help="B=128, K=7, V=129280, one round")
    p.add_argument("--json", default=None, help="write results here")


QUICK = {"batch": 128, "drafts": 7, "vocabs": "129280", "iters": 5, "rounds": 1}


@jax.jit
def _read_once(p, q):
    """Touches every byte of p and q once: the measured read bandwidth."""
    return jnp.sum(p, axis=(1, 2)) + jnp.sum(q, axis=(1, 2))


@jax.jit
def _read_p(p):
    """Touches every byte of p once."""
    return jnp.sum(p, axis=(1, 2))


@jax.jit
def common_approach(key, drafts, q, p):
    """Race over the whole vocabulary at every position, then keep the first rejection's.

    Residual rows for j < K, p_K for the bonus; exponentials E [B, K+1, V] for all of them.
    """
    b, k = drafts.shape
    k_acc, k_race = jax.random.split(key)
    u = jax.random.uniform(k_acc, (b, k))
    p_d, q_d = draft_token_probs(drafts, q, p)
    accepted = count_accepted(p_d, q_d, u, jnp.full((b,), k, jnp.int32))
    residual = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)
    residual = jnp.where(jnp.any(residual > 0, -1, keepdims=True), residual, p)
    e = jax.random.exponential(k_race, residual.shape)
    tokens = jnp.argmax(residual / e, axis=-1).astype(jnp.int32)  # [B, K+1]
    token = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
    return assemble_output(drafts, accepted, token), accepted


def make_inputs(b: int, k: int, v: int, seed: int = 0):
    kp, kq, kd = jax.random.split(jax.random.key(seed), 3)
    # Peaked rows (like a trained model's), so acceptance and rejection both happen.
    p = jax.nn.softmax(4.0 * jax.random.normal(kp, (b, k + 1, v)), axis=-1)
    q = jax.nn.softmax(jnp.log(p[:, :k] + 1e-9) + jax.random.normal(kq, (b, k, v)), axis=-1)
    drafts = jax.random.categorical(kd, jnp.log(q), axis=-1).astype(jnp.int32)
    return drafts, q, p


KEY = jax.random.key(1)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    b, k = args.batch, args.drafts
    on_accelerator = jax.default_backend() != "cpu"
    impls = ["xla", "reference"] + (["pallas"] if on_accelerator else [])
    rows = []
    for v in [int(x) for x in args.vocabs.split(",")]:
        drafts, q, p = make_inputs(b, k, v)
        nbytes = p.nbytes + q.nbytes
        fns = {"bound": lambda p=p, q=q: _read_once(p, q), "read_p": lambda p=p: _read_p(p)}
        for impl in impls:
            fn = jax.jit(
                lambda key, d, q, p, impl=impl: speculative_sample(key, d, q, p, impl=impl)
            )
            fns[impl] = lambda fn=fn, d=drafts, q=q, p=p: fn(KEY, d, q, p)
        fns["common"] = lambda d=drafts, q=q, p=p: common_approach(KEY, d, q, p)
        best = {name: float("inf") for name in fns}
        for _ in range(args.rounds):  # interleaved rounds: every variant sees the same drift
            for name, fn in fns.items():
                t = time_call(fn, iters=args.iters)["median_s"]
                best[name] = min(best[name], t)
        bound_s = best["bound"]
        for name in ["bound", "read_p", *impls, "common"] + ([] if on_accelerator else ["pallas"]):
            t = best.get(name)
            rows.append(
                {
                    "variant": "race_row" if name == "reference" else name,
                    "B": b,
                    "K": k,
                    "V": v,
                    "prob_bytes": nbytes,
                    "ms": None if t is None else 1e3 * t,
                    "ratio_to_bound": None if t is None else t / bound_s,
                    "ratio_to_read_p": None if t is None else t / best["read_p"],
                    "read_GBps": nbytes / bound_s / 1e9 if name == "bound" else None,
                    "note": "Pallas is interpreted on CPU: not timed" if t is None else "",
                }
            )
    cols = ["variant", "B", "K", "V", "ms", "ratio_to_bound", "ratio_to_read_p", "read_GBps"]
    cols.append("note")
    print(format_table([{c: ("-" if r[c] is None else r[c]) for c in cols} for r in rows], cols))
    write_json(args.json, {"machine": machine_info(), "rows": rows})
    return 0
