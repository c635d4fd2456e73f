"""mHC residual-path traffic: bytes and time per token of one sub-layer's residual path.

Variants (activation traffic per token per sub-layer of the mHC forms), each one jitted
function of the sub-layer's activations (x [T, n, C], F's output y [T, C]) and its per-token
coefficients (Sinkhorn etc. act on n^2 + 2n numbers per token and are left out):
  plain        x + y on one stream [T, C]                         (2C read, C written)
  naive        coefficient stats (vec(x) phi', sum x^2), pre-mix H_pre x, post H_post^T y,
               residual H_res x and their sum, each stage materialised behind an
               optimization barrier                               ((5n+1)C read, (3n+1)C written)
  fused        the paper's kernels: stats pass, pre-mix pass, one post + residual pass
               (``v41jax.mhc.fused``)                             ((3n+1)C read, (n+1)C written)
  single_pass  the lagged one-pass step (``v41jax.mhc.single_pass``, impl "xla"): X_{l+1},
               the next normalised input and the next stats       ((n+1)C read, (n+1)C written)
  single_pass_kernel  (GPU/TPU runs only) the compiled kernel, impl "pallas", timed.
  single_pass_pallas_{tpu,gpu}  the Pallas kernels of the same step (Mosaic TPU, Triton
               GPU), for each C of --kernel-widths: bytes from the kernel's own BlockSpecs
               (a block moves when its index changes between grid steps, so phi moves once),
               with the tiles the kernel picks for that shape; not timed on CPU, where Pallas
               only runs interpreted. The GPU kernel's second phase re-reads its h tiles
               (L2, not in the block specs): l2_reread_bytes_per_token.
bytes_per_token is XLA's cost analysis ('bytes accessed', fusion aware) of the compiled
function on this machine / tokens; bound_bytes_per_token is (2n+2)C x element size.
us_per_token is measured side by side in the same run (best median over rounds).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from v41jax.bench.common import format_table, machine_info, positive_int, time_call, write_json
from v41jax.kernels.mhc_single_pass import mhc_single_pass
from v41jax.kernels.mhc_single_pass.kernel import block_specs
from v41jax.kernels.mhc_single_pass.plan import TARGETS, block_traffic, make_plan
from v41jax.mhc.fused import fused_post_residual, naive_post_residual, pre_mix
from v41jax.mhc.single_pass import stream_stats

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
VARIANTS = ("plain", "naive", "fused", "single_pass")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=positive_int, default=4, help="n")
    p.add_argument("--width", type=positive_int, default=1024, help="C")
    p.add_argument("--tokens", type=positive_int, default=4096, help="T (batch x length)")
    p.add_argument("--dtypes", default="f32,bf16", help=f"comma list of {sorted(DTYPES)}")
    p.add_argument(
        "--kernel-widths", default="1024,4096,7168", help="C values of the kernel byte rows"
    )
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--rounds", type=positive_int, default=3, help="timing rounds, best median kept")
    p.add_argument("--json", default=None, help="write results here")


def analytic_elements(variant: str, n: int) -> int:
    """Elements read + written per token per sub-layer, in units of C (each form's design)."""
    return {
        "plain": 3,
        "naive": (5 * n + 1) + (3 * n + 1),
        "fused": (3 * n + 1) + (n + 1),
        "single_pass": (n + 1) + (n + 1),
        "single_pass_kernel": (n + 1) + (n + 1),
        "single_pass_pallas_tpu": (n + 1) + (n + 1),
        "single_pass_pallas_gpu": (n + 1) + (n + 1),
    }[variant]


def _naive(x, y, h_pre, h_post, h_res, phi):
    stats = lax.optimization_barrier(stream_stats(x, phi))
    h_in = lax.optimization_barrier(pre_mix(x, h_pre))
    return naive_post_residual(x, y, h_post, h_res), h_in, stats


def _fused(x, y, h_pre, h_post, h_res, phi):
    stats = stream_stats(x, phi)
    h_in = pre_mix(x, h_pre)
    return fused_post_residual(x, y, h_post, h_res), h_in, stats


def _single_pass(x, y, h_pre, h_post, h_res, phi, g):
    return mhc_single_pass(x, y, h_res, h_post, h_pre, phi, g, impl="xla")


def _single_pass_kernel(x, y, h_pre, h_post, h_res, phi, g):
    return mhc_single_pass(x, y, h_res, h_post, h_pre, phi, g, impl="pallas")


def _inputs(n: int, c: int, tokens: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    k = n * n + 2 * n
    return {
        "x": f(tokens, n, c).astype(dtype),
        "y": f(tokens, c).astype(dtype),
        "h_pre": jax.nn.sigmoid(f(tokens, n)),
        "h_post": 2 * jax.nn.sigmoid(f(tokens, n)),
        "h_res": jax.nn.softmax(f(tokens, n, n), axis=-1),
        "phi": f(n * c, k) / np.sqrt(n * c),
        "g": jnp.ones((c,), jnp.float32),
        "x_plain": f(tokens, c).astype(dtype),
    }


def _variant_call(variant: str, a: dict):
    """(jitted fn, its args) of one variant."""
    if variant == "plain":
        return jax.jit(lambda x, y: x + y), (a["x_plain"], a["y"])
    coeffs = (a["x"], a["y"], a["h_pre"], a["h_post"], a["h_res"], a["phi"])
    if variant == "naive":
        return jax.jit(_naive), coeffs
    if variant == "fused":
        return jax.jit(_fused), coeffs
    if variant == "single_pass_kernel":
        return jax.jit(_single_pass_kernel), (*coeffs, a["g"])
    return jax.jit(_single_pass), (*coeffs, a["g"])


def pallas_kernel_rows(n: int, c: int, tokens: int, dtype, dtype_name: str) -> list[dict]:
    """Per kernel variant: HBM bytes per token from its block specs, with its tiles."""
    k = n * n + 2 * n
    item = jnp.dtype(dtype).itemsize
    bound = (2 * n + 2) * c * item
    rows = []
    for target in TARGETS:
        plan = make_plan(
            target,
            num=tokens,
            n=n,
            c=c,
            k=k,
            x_item=item,
            out_item=item,
            with_norm=True,
            norm_eps=1e-6,
            out_dtype=dtype,
        )
        grid, ins, outs = block_specs(plan, tokens, n, c, k, dtype, True)
        per_token = block_traffic(grid, ins + outs) / tokens
        variant = f"single_pass_pallas_{target}"
        rows.append(
            {
                "variant": variant,
                "dtype": dtype_name,
                "n": n,
                "C": c,
                "tokens": tokens,
                "block_tokens": plan.block_tokens,
                "block_c": plan.block_c,
                "vmem_limit_bytes": plan.vmem_limit_bytes,
                "bytes_per_token": per_token,
                "bytes_source": "kernel BlockSpecs (interpreted on CPU: no XLA cost analysis)",
                "l2_reread_bytes_per_token": float(2 * c * item) if target == "gpu" else 0.0,
                "analytic_bytes_per_token": float(analytic_elements(variant, n) * c * item),
                "bound_bytes_per_token": float(bound),
                "ratio_to_bound": per_token / bound,
                "us_per_token": None,
                "overhead_vs_plain": None,
            }
        )
    return rows


def bench_dtype(args, dtype_name: str) -> list[dict]:
    n, c, tokens = args.streams, args.width, args.tokens
    dtype = DTYPES[dtype_name]
    elem = jnp.dtype(dtype).itemsize
    bound = (2 * n + 2) * c * elem
    a = _inputs(n, c, tokens, dtype)
    # On a GPU/TPU the compiled kernel is timed too (cost analysis: its CostEstimate).
    on_device = jax.default_backend() in ("gpu", "tpu")
    variants = VARIANTS + (("single_pass_kernel",) if on_device else ())
    calls = {v: _variant_call(v, a) for v in variants}
    rows = {}
    for v, (fn, fargs) in calls.items():
        cost = fn.lower(*fargs).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows[v] = {
            "variant": v,
            "dtype": dtype_name,
            "n": n,
            "C": c,
            "tokens": tokens,
            "bytes_per_token": float(cost["bytes accessed"]) / tokens,
            "analytic_bytes_per_token": float(analytic_elements(v, n) * c * elem),
            "bound_bytes_per_token": float(bound),
            "us_per_token": float("inf"),
        }
    # Rounds interleave the variants, so a busy spell of the machine hits them all.
    for _ in range(args.rounds):
        for v, (fn, fargs) in calls.items():
            t = time_call(lambda fn=fn, fargs=fargs: fn(*fargs), warmup=2, iters=args.iters)
            us = t["median_s"] / tokens * 1e6
            rows[v]["us_per_token"] = min(rows[v]["us_per_token"], us)
    plain_us = rows["plain"]["us_per_token"]
    for r in rows.values():
        r["ratio_to_bound"] = r["bytes_per_token"] / bound
        r["overhead_vs_plain"] = r["us_per_token"] / plain_us - 1.0
    out = list(rows.values())
    for width in sorted({int(w) for w in args.kernel_widths.split(",") if w}):
        out += pallas_kernel_rows(n, width, tokens, dtype, dtype_name)
    return out


def run(args) -> int:
    rows = []
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            raise SystemExit(f"mhc bench: unknown dtype {name!r}; choose from {sorted(DTYPES)}")
        rows += bench_dtype(args, name)
    cols = [
        "variant",
        "dtype",
        "C",
        "bytes_per_token",
        "analytic_bytes_per_token",
        "bound_bytes_per_token",
        "ratio_to_bound",
        "us_per_token",
        "overhead_vs_plain",
    ]
    shown = [{k: ("-" if v is None else v) for k, v in r.items()} for r in rows]
    print(format_table(shown, cols))
    print(
        f"n={args.streams} C={args.width} (timed variants) T={args.tokens}; bytes_per_token: XLA "
        "cost analysis ('bytes accessed') / T, for the Pallas rows their block specs / T; "
        "overhead_vs_plain: us_per_token / plain's - 1"
    )
    write_json(args.json, {"rows": rows, "machine": machine_info(), "args": vars(args)})
    return 0
