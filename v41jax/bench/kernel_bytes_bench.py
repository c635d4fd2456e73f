"""Kernel bytes from the TPU compiler: each Pallas kernel compiled for one v5e chip.

Needs the `aot` extra (libtpu; `bash scripts/test_aot.sh` makes .venv-aot). Nothing runs:
each kernel is compiled ahead of time for a compile-only v5e chip
(`v41jax.kernels.aot`), and per row it reports, per token (mHC), per id (Engram) or per
verified row (verification):

  bound        the least the operation can move: mHC's single pass (2n+2)C elements
               (X and y read, X_{l+1} and the next normalised input written); the Engram
               lookup's row read once, the f32 output written, the id (and fp8 scale) read;
               verification's p (and q) read once.
  model        the kernel's own byte count (its block specs / `pl.CostEstimate`): what
               the kernel promises; the Engram TPU kernel's DMA reads each row's aligned
               group (16 rows for bf16, 32 for fp8), which is here.
  kernel       what the compiled program records for the Mosaic call (its cost estimate,
               carried into the compiled HLO: equal to `model` unless the wrapper's shapes
               differ from what the kernel was planned for).
  program      `cost_analysis()["bytes accessed"]` of the whole compiled TPU program: the
               kernel plus every XLA op around it (pads, transposes, the scale gather), as
               the compiler fused and laid them out. program - kernel is the wrapper's own
               traffic, which only the compiler can tell.
  scoped VMEM  what Mosaic reserved for the kernel (`used_scoped_memory_configs`).

What it cannot say: how fast (the device check times the kernels on a chip).
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp

from v41jax.bench.common import format_table, machine_info, write_json
from v41jax.kernels import aot
from v41jax.kernels.engram_lookup import engram_lookup
from v41jax.kernels.engram_lookup.kernel import lookup_cost, rows_per_dma
from v41jax.kernels.mhc_single_pass import mhc_single_pass
from v41jax.kernels.mhc_single_pass.kernel import block_specs
from v41jax.kernels.mhc_single_pass.plan import block_traffic, make_plan
from v41jax.kernels.spec_verify import spec_verify
from v41jax.kernels.spec_verify.limits import verify_cost

S = jax.ShapeDtypeStruct
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
_COST_RE = re.compile(r'"cost_estimate":\{[^}]*"bytes_accessed":"?(\d+)')


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="v5e:2x4", help="TPU slice; one chip of it is used")
    p.add_argument("--tokens", type=int, default=8192, help="mHC tokens per chip")
    p.add_argument("--json", default=None, help="write results here")


def kernel_cost_bytes(text: str) -> int:
    """Sum of the Mosaic calls' cost-estimate bytes in a compiled TPU program's text."""
    total = 0
    for line in text.splitlines():
        if f'custom_call_target="{aot.MOSAIC_CUSTOM_CALL}"' in line:
            total += sum(int(b) for b in _COST_RE.findall(line.replace('\\"', '"')))
    return total


def _compile(fn, args, chip) -> dict:
    compiled, record = aot.compile_for(fn, args, chip)
    text = compiled.as_text() or ""
    return {
        "program_bytes": record.bytes_accessed,
        "kernel_bytes": kernel_cost_bytes(text),
        "scoped_vmem_bytes": sum(record.scoped_vmem_bytes),
        "mosaic_calls": len(record.scoped_vmem_bytes),
        "compile_s": record.seconds,
    }


def mhc_rows(chip, tokens: int) -> list[dict]:
    """mHC single pass (impl "pallas"), n = 4, with the next sub-layer's statistics."""
    n, rows = 4, []
    k = n * n + 2 * n
    for c, name in ((1024, "bf16"), (1024, "f32"), (7168, "bf16"), (1000, "bf16")):
        dtype = DTYPES[name]
        item = jnp.dtype(dtype).itemsize
        f32 = jnp.float32
        args = [
            S((tokens, n, c), dtype),
            S((tokens, c), dtype),
            S((tokens, n, n), f32),
            S((tokens, n), f32),
            S((tokens, n), f32),
            S((n * c, k), f32),
            S((c,), f32),
        ]
        plan = make_plan(
            "tpu",
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
        got = _compile(lambda *a: mhc_single_pass(*a, impl="pallas"), args, chip)
        rows.append(
            _row(
                "mhc_single_pass",
                f"n=4 C={c} {name}",
                tokens,
                "token",
                bound=(2 * n + 2) * c * item * tokens,
                model=block_traffic(grid, ins + outs),
                got=got,
            )
        )
    return rows


def engram_rows(chip) -> list[dict]:
    """The Engram TPU DMA gather: the flagship fp8 table (one chip's 1024 x 24 ids) and the
    odd bf16 one; f32 output."""
    rows = []
    cases = [
        ("fp8", (1 << 24, 256), (1024, 24), True),
        ("bf16", (999_983, 64), (3, 1001, 7), False),
        ("f32", (1 << 20, 256), (1024, 24), False),
    ]
    for name, (r, e), ids_shape, scaled in cases:
        dtype = DTYPES[name]
        ids = S(ids_shape, jnp.int32)
        args = [S((r, e), dtype), ids, S((r,), jnp.float32) if scaled else None]
        num = math.prod(ids_shape)
        group = rows_per_dma(dtype)
        model = lookup_cost(num, e, dtype, jnp.float32, scaled, group).bytes_accessed
        bound = lookup_cost(num, e, dtype, jnp.float32, scaled, 1).bytes_accessed
        got = _compile(lambda t, i, s: engram_lookup(t, i, s), args, chip)
        label = f"{r:,} x {e} {name}, {num:,} ids"
        rows.append(_row("engram_lookup", label, num, "id", bound, model, got))
    return rows


def verify_rows(chip) -> list[dict]:
    """Verification's blocked TPU kernel over a whole V = 129,280 row, K = 7, 8 rows."""
    b, k, v, rows = 8, 7, 129_280, []
    for name, with_q in (("f32", False), ("bf16", True)):
        dtype = DTYPES[name]
        args = [
            S((b, k), jnp.int32),
            S((b, k, v), dtype) if with_q else None,
            S((b, k + 1, v), dtype),
            S((b,), jnp.int32),
            S((b, k), jnp.float32),
            S((b, v), jnp.float32),
        ]
        item = jnp.dtype(dtype).itemsize
        bound = b * (k + 1) * v * item + (b * k * v * item if with_q else 0)
        model = verify_cost(b, k, v, args).bytes_accessed
        fn = lambda *a: spec_verify(*a, impl="pallas", block_v=v)  # noqa: E731
        got = _compile(fn, args, chip)
        label = f"K={k} V={v:,} {name} {'with q' if with_q else 'one-hot drafts'}"
        rows.append(_row("spec_verify", label, b, "row", bound, model, got))
    return rows


def _row(kernel, case, units, unit, bound, model, got) -> dict:
    per = lambda x: None if x is None else float(x) / units  # noqa: E731
    return {
        "kernel": kernel,
        "case": case,
        "unit": unit,
        "bound_bytes": per(bound),
        "model_bytes": per(model),
        "kernel_bytes": per(got["kernel_bytes"]),
        "program_bytes": per(got["program_bytes"]),
        "model_over_bound": float(model) / bound,
        "program_over_bound": None
        if got["program_bytes"] is None
        else got["program_bytes"] / bound,
        "scoped_vmem_mib": got["scoped_vmem_bytes"] / (1 << 20),
        "mosaic_calls": got["mosaic_calls"],
        "compile_s": got["compile_s"],
    }


def run(args) -> int:
    missing = aot.missing_tpu_compiler()
    if missing:
        raise SystemExit(f"kernel_bytes bench: {missing}")
    topo = aot.tpu_topology(args.topology)
    chip = topo.devices[:1]
    rows = mhc_rows(chip, args.tokens) + engram_rows(chip) + verify_rows(chip)
    cols = ["kernel", "case", "unit", "bound_bytes", "model_bytes", "kernel_bytes"]
    cols += ["program_bytes", "model_over_bound", "program_over_bound", "scoped_vmem_mib"]
    print(format_table(rows, cols))
    print(
        f"bytes per unit, one chip of {args.topology} ({topo.devices[0].device_kind}); bound: "
        "the operation's least traffic; model: the kernel's own count; kernel: the Mosaic "
        "call's cost in the compiled program; program: the compiler's cost_analysis() of it all"
    )
    payload = {"rows": rows, "machine": machine_info(), "args": vars(args)}
    payload["device_kind"] = topo.devices[0].device_kind
    write_json(args.json, payload)
    return 0
