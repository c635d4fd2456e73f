"""Compile cost of the train step vs depth: scanned layer runs vs one unrolled block per layer.

For each depth L and `model.scan_layers` on/off, the config's jitted train step
(`v41jax.train.step.make_train_step`: forward, backward, AdamW update) is traced and lowered
from abstract state and batch shapes (no parameters are allocated), then compiled. Reported
per row: lower_s (trace + lower to StableHLO), compile_s (XLA compile), total_s (their sum,
wall-clock), the StableHLO text size (`Lowered.as_text()`) and the optimised HLO text size
(`Compiled.as_text()`), in characters. With scan, the program holds one block body per run
of identical layers, so both sizes and the compile time should stay roughly flat in L;
unrolled, they grow linearly.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.bench.common import format_table, machine_info, write_json
from v41jax.sharding import make_mesh
from v41jax.train.batches import batch_keys
from v41jax.train.state import make_state_fns
from v41jax.train.step import make_train_step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--layers", default="4,16,32", help="comma-separated depths")
    p.add_argument("--scan", default="on,off", help="scan settings to measure: on, off or both")
    p.add_argument("--json", default=None, help="write results here")


def abstract_batch(cfg: config_lib.Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """ShapeDtypeStructs of one training batch (ids int32 [B, T], loss mask float32)."""
    b, t = cfg.data.global_batch_size, cfg.data.seq_len
    heads = cfg.model.engram.num_heads_total
    spec = sharding.batch_sharding(mesh)
    out = {}
    for key in batch_keys(cfg.model):
        shape = (b, t, heads) if key.startswith("engram_ids_") else (b, t)
        dtype = jnp.float32 if key == "loss_mask" else jnp.int32
        out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=spec)
    return out


def measure(cfg: config_lib.Config) -> dict[str, float | int]:
    """Lower + compile the train step of `cfg` from abstract inputs; times and sizes."""
    mesh = make_mesh(cfg.mesh)
    model, optimizer, _, shardings, abstract = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    batch = abstract_batch(cfg, mesh)
    with jax.set_mesh(mesh), sharding.axis_rules():
        start = time.perf_counter()
        lowered = step.jitted.trace(abstract, batch).lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
    return {
        "lower_s": lowered_at - start,
        "compile_s": done - lowered_at,
        "total_s": done - start,
        "stablehlo_chars": len(lowered.as_text()),
        "hlo_chars": len(compiled.as_text()),
    }


def run(args) -> int:
    base = config_lib.override(config_lib.get_config(args.config), args.overrides)
    depths = [int(x) for x in args.layers.split(",")]
    scans = [s.strip() for s in args.scan.split(",")]
    bad = [s for s in scans if s not in ("on", "off")]
    if bad:
        raise ValueError(f"--scan takes 'on' and/or 'off', got {bad}")
    rows = []
    for scan in scans:
        for depth in depths:
            cfg = config_lib.override(
                base, [f"model.num_layers={depth}", f"model.scan_layers={scan == 'on'}".lower()]
            )
            row = {"config": cfg.name, "layers": depth, "scan": scan, **measure(cfg)}
            rows.append(row)
            print(f"  L={depth} scan={scan}: {row['total_s']:.1f} s", flush=True)
    for scan in scans:  # the ratios the target is stated in: deepest vs shallowest
        mine = [r for r in rows if r["scan"] == scan]
        lo, hi = min(mine, key=lambda r: r["layers"]), max(mine, key=lambda r: r["layers"])
        for r in mine:
            r["total_vs_shallowest"] = r["total_s"] / lo["total_s"]
            r["hlo_vs_shallowest"] = r["hlo_chars"] / lo["hlo_chars"]
        print(
            f"scan={scan}: L={hi['layers']} / L={lo['layers']}: compile "
            f"{hi['total_s'] / lo['total_s']:.2f}x, HLO {hi['hlo_chars'] / lo['hlo_chars']:.2f}x"
        )
    cols = [
        "layers",
        "scan",
        "lower_s",
        "compile_s",
        "total_s",
        "total_vs_shallowest",
        "stablehlo_chars",
        "hlo_chars",
        "hlo_vs_shallowest",
    ]
    print(format_table(rows, cols))
    write_json(args.json, {"rows": rows, "machine": machine_info()})
    return 0
