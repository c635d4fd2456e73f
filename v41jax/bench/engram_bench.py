"""Engram vs an equal-parameter dense FFN, and the lookup's bandwidth, side by side.

Part 1, per table size P (parameters in the Engram tables): the per-token time of the whole
Engram layer (device hashing of the compressed ids + lookup + gate + value projection) and of
a SwiGLU FFN holding the same P parameters, both jitted forward passes at hidden size D; the
FLOPs per token of each from XLA's cost analysis. Engram's work per token is O(1) in P; the
FFN's grows linearly. FFNs stop at `--ffn-max-params` (f32 weights, and seconds per call).

Part 2, gathered bytes/s of the lookup paths on the largest f32 table vs memcpy bytes/s of a
buffer of the same size as the gathered rows, measured in the same run: XLA (`engram_lookup`
impl "xla"), plain `jnp.take`, and the host-memory table (`HostTable`, numpy gather on 1 and
all threads).

On a GPU/TPU, part 2 is instead the device lookup (`device_bandwidth_rows`): XLA, the
Pallas kernel and `jnp.take` on the f32 table and on an FP8 table with row scales
(2^24 x 256, 4 GiB, by default), as bytes moved (rows read + output written) per second
against a device copy measured in the same run (and `--peak-gbps`, the chip's nominal
bandwidth, when given). `--quick`: small sizes and few iterations, under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from v41jax.bench.common import format_table, machine_info, positive_int, time_call, write_json
from v41jax.engram import (
    EngramConfig,
    dense_param_count,
    engram_forward,
    ngram_hash_ids_jax,
    size_tables_for_budget,
    stored_table_rows,
    table_param_count,
)
from v41jax.engram.host_table import FP8_NUMPY, HostTable
from v41jax.kernels.engram_lookup.api import engram_lookup
from v41jax.model.layers import swiglu


def token_shape(tokens: int, length: int = 512) -> tuple[int, int]:
    """[batch, length] of exactly `tokens` tokens: rows of `length` when it divides them, else
    one row of all of them."""
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    return (tokens // length, length) if tokens % length == 0 else (1, tokens)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1e6,1e7,1e8,5e8,2e9", help="table params per row")
    p.add_argument("--fp8-from", type=float, default=1e9, help="FP8 tables from this size")
    p.add_argument("--ffn-max-params", type=float, default=5e8)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=2048,
        help="Engram tokens N per call: [N/512, 512] if 512 divides N, else [1, N]",
    )
    p.add_argument("--ffn-tokens", type=positive_int, default=256, help="FFN tokens per call")
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--fp8-rows", type=positive_int, default=1 << 24, help="device FP8 table rows")
    p.add_argument("--peak-gbps", type=float, default=None, help="chip memory bandwidth")
    p.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    p.add_argument("--json", default=None)


QUICK = {"sizes": "1e6,1e7", "ffn_max_params": 1e7, "iters": 3, "fp8_rows": 1 << 22}


BASE = EngramConfig(
    max_ngram_size=3,
    n_embed_per_ngram=256,
    n_head_per_ngram=8,
    layer_ids=(0,),
    compressed_vocab_size=50_000,
    engram_vocab_size=(1000, 1000),
)


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", float("nan")))


def _engram_params(cfg: EngramConfig, d: int, fp8: bool) -> dict:
    """Params of one Engram layer; the table filled cheaply (timing does not read values)."""
    rows, c, e = stored_table_rows(cfg, 0), cfg.head_dim, cfg.embed_dim
    if fp8:  # random bytes below 0x7f are finite positive e4m3 values
        raw = np.random.default_rng(0).integers(0, 0x7E, (rows, c), dtype=np.uint8)
        table = jnp.asarray(raw.view(FP8_NUMPY))
        extra = {"table_scale": jnp.ones((rows,), jnp.float32)}
    else:
        table, extra = jnp.asarray(np.full((rows, c), 0.01, np.float32)), {}
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    return {
        "table": table,
        **extra,
        "w_v": jax.random.normal(k[0], (e, d)) / np.sqrt(e),
        "b_v": jnp.zeros((d,)),
        "w_k": jax.random.normal(k[1], (e, 1, d)) / np.sqrt(e),
        "b_k": jnp.zeros((1, d)),
        "key_norm": jnp.ones((1, d)),
        "query_norm": jnp.ones((1, d)),
    }


def sized(target: float, hidden: int) -> EngramConfig:
    """BASE with per-order sizes giving ~target TABLE parameters (the budget helper counts
    the projections too, so they are added to the target)."""
    return size_tables_for_budget(BASE, hidden, int(target) + dense_param_count(BASE, hidden))


def engram_row(target: float, args) -> dict:
    cfg = sized(target, args.hidden)
    fp8 = target >= args.fp8_from
    cfg = dataclasses.replace(cfg, table_dtype="float8_e4m3fn" if fp8 else "float32")
    params = _engram_params(cfg, args.hidden, fp8)
    b, t = token_shape(args.tokens)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((b, t, args.hidden), np.float32))
    comp = [
        jnp.asarray(rng.integers(0, cfg.compressed_vocab_size, (b, t), dtype=np.int32))
        for _ in range(2)
    ]

    def layer(params, h, comp):
        ids = ngram_hash_ids_jax(comp, 0, cfg)
        return engram_forward(params, h, ids, cfg, 0)

    f = jax.jit(layer)
    state = {"i": 0}

    def call():
        state["i"] += 1
        return f(params, h, comp[state["i"] % 2])

    timing = time_call(call, warmup=2, iters=args.iters)
    return {
        "kind": "engram",
        "table_params": table_param_count(cfg),
        "table_dtype": cfg.table_dtype,
        "table_bytes": int(params["table"].nbytes),
        "us_per_token": timing["median_s"] / (b * t) * 1e6,
        "flops_per_token": _flops(layer, params, h, comp[0]) / (b * t),
    }


def ffn_row(target: float, args) -> dict:
    d = args.hidden
    f_width = max(1, int(target // (3 * d)))
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w = [
        jax.random.normal(k[0], (d, f_width)) * 0.02,
        jax.random.normal(k[1], (d, f_width)) * 0.02,
        jax.random.normal(k[2], (f_width, d)) * 0.02,
    ]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, args.ffn_tokens, d), np.float32))
    fn = jax.jit(swiglu)
    timing = time_call(lambda: fn(x, *w), warmup=1, iters=max(2, args.iters // 2))
    return {
        "kind": "dense_ffn",
        "table_params": 3 * d * f_width,
        "table_dtype": "float32",
        "table_bytes": 3 * d * f_width * 4,
        "us_per_token": timing["median_s"] / args.ffn_tokens * 1e6,
        "flops_per_token": _flops(swiglu, x, *w) / args.ffn_tokens,
    }


def _best_bytes_per_s(fn, nbytes: int, iters: int) -> float:
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def bandwidth_rows(args, target: float) -> list[dict]:
    """Gathered bytes/s of each lookup path on one f32 table vs memcpy, same run."""
    cfg = sized(target, args.hidden)
    rows, c, h = stored_table_rows(cfg, 0), cfg.head_dim, cfg.num_heads_total
    table_np = np.full((rows, c), 0.01, np.float32)
    table = jnp.asarray(table_np)
    n = args.tokens * 8
    rng = np.random.default_rng(2)
    ids_np = [rng.integers(0, rows - 128, (n, h)).astype(np.int32) for _ in range(args.iters + 2)]
    ids = [jnp.asarray(i) for i in ids_np]
    nbytes = n * h * c * 4
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    memcpy = _best_bytes_per_s(lambda: np.copyto(dst, src), nbytes, args.iters * 2)
    xla, take = jax.jit(engram_lookup), jax.jit(lambda t, i: jnp.take(t, i, axis=0))

    def cycle(fn, arrays):
        it = iter(arrays * 3)
        return lambda: fn(next(it))

    paths = {
        "xla engram_lookup": cycle(lambda i: xla(table, i), ids),
        "jnp.take": cycle(lambda i: take(table, i), ids),
    }
    for threads in sorted({1, HostTable(table_np[:1], threads=None).threads}):
        host = HostTable(table_np, threads=threads)
        paths[f"host numpy x{threads}"] = cycle(host.gather, ids_np)
    out = []
    for name, fn in paths.items():
        fn()  # compile / warm
        bps = _best_bytes_per_s(fn, nbytes, args.iters)
        out.append(
            {
                "path": name,
                "table_bytes": table_np.nbytes,
                "gathered_bytes": nbytes,
                "gb_per_s": bps / 1e9,
                "memcpy_gb_per_s": memcpy / 1e9,
                "fraction_of_memcpy": bps / memcpy,
            }
        )
    return out


def _device_copy_gbps(nbytes: int, iters: int) -> float:
    """Bytes moved (read + written) per second by a jitted elementwise pass over a device
    buffer of ``nbytes // 2``: the reachable memory bandwidth of this chip."""
    x = jnp.ones((nbytes // 8,), jnp.float32)
    fn = jax.jit(lambda x: x * 2.0)
    return _best_bytes_per_s(lambda: fn(x), 2 * x.nbytes, iters) / 1e9


def device_bandwidth_rows(args, target: float) -> list[dict]:
    """Lookup bytes moved per second on the accelerator: the f32 table of ``target``
    parameters and an FP8 table (``--fp8-rows`` x 256, row scales), vs a device copy."""
    cfg = sized(target, args.hidden)
    rng = np.random.default_rng(3)
    heads = cfg.num_heads_total
    n = args.tokens * 4
    tables = {
        "f32": (jnp.full((stored_table_rows(cfg, 0), cfg.head_dim), 0.01, jnp.float32), None),
        "fp8": (
            jnp.ones((args.fp8_rows, 256), jnp.float8_e4m3fn),
            jnp.ones((args.fp8_rows,), jnp.float32),
        ),
    }
    copy = _device_copy_gbps(1 << 30, args.iters * 2)
    out = []
    for kind, (table, scale) in tables.items():
        rows, emb = table.shape
        ids = [
            jnp.asarray(rng.integers(0, rows, (n, heads)), jnp.int32) for _ in range(args.iters + 2)
        ]
        moved = n * heads * emb * (table.dtype.itemsize + 4)  # rows read + f32 output written
        paths = {f"{impl} engram_lookup": impl for impl in ("xla", "pallas")}
        for name, impl in paths.items():
            fn = jax.jit(lambda t, i, s, impl=impl: engram_lookup(t, i, s, impl=impl))
            it = iter(ids * 3)
            call = lambda fn=fn, it=it, t=table, s=scale: fn(t, next(it), s)  # noqa: E731
            call()  # compile / warm
            gbps = _best_bytes_per_s(call, moved, args.iters) / 1e9
            row = {"table": kind, "table_bytes": table.nbytes, "path": name, "gb_per_s": gbps}
            row["copy_gb_per_s"], row["fraction_of_copy"] = copy, gbps / copy
            if args.peak_gbps:
                row["fraction_of_peak"] = gbps / args.peak_gbps
            out.append(row)
    return out


def run(args) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    on_accelerator = jax.default_backend() != "cpu"
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    for target in tqdm(sizes, desc="engram vs ffn"):
        rows.append(engram_row(target, args))
        if target <= args.ffn_max_params:
            rows.append(ffn_row(target, args))
    cols = ["kind", "table_params", "table_dtype", "table_bytes", "us_per_token", "flops_per_token"]
    print(format_table(rows, cols))
    eng = [r for r in rows if r["kind"] == "engram"]
    ffn = [r for r in rows if r["kind"] == "dense_ffn"]
    growth = {
        "engram_time_growth": eng[-1]["us_per_token"] / eng[0]["us_per_token"],
        "engram_param_growth": eng[-1]["table_params"] / eng[0]["table_params"],
        "ffn_time_growth": ffn[-1]["us_per_token"] / ffn[0]["us_per_token"] if ffn else None,
        "ffn_param_growth": ffn[-1]["table_params"] / ffn[0]["table_params"] if ffn else None,
    }
    print({k: round(v, 3) if v else v for k, v in growth.items()})
    f32_sizes = [s for s in sizes if s < args.fp8_from]
    if on_accelerator:
        bw = device_bandwidth_rows(args, max(f32_sizes))
        cols = ["table", "table_bytes", "path", "gb_per_s", "copy_gb_per_s", "fraction_of_copy"]
        cols += ["fraction_of_peak"] if args.peak_gbps else []
    else:
        bw = bandwidth_rows(args, max(f32_sizes))
        cols = ["path", "table_bytes", "gathered_bytes", "gb_per_s", "memcpy_gb_per_s"]
        cols += ["fraction_of_memcpy"]
    print(format_table(bw, cols))
    write_json(
        args.json,
        {
            "rows": rows,
            "growth": growth,
            "bandwidth": bw,
            "hidden": args.hidden,
            "machine": machine_info(),
        },
    )
    return 0
