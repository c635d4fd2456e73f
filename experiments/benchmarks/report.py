"""The benchmark tables of experiments/benchmarks/README.md, rendered from the committed JSON.

python experiments/benchmarks/report.py     (writes results/tables.md and prints it)

Each `python -m v41jax.bench NAME --json experiments/benchmarks/NAME.json` writes one JSON;
`render_tables(bench_dir)` turns all of them into markdown, one section per table, and the
README copies those tables verbatim (`tests/test_readme_figures.py` checks both).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _md(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def sig(x: float | None, digits: int = 3) -> str:
    """x to `digits` significant figures, no exponent, thousands separated; None: '-'."""
    if x is None:
        return "-"
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def ratio(x: float) -> str:
    """A ratio as the README writes it: 0.40x, 11.7x, 71x."""
    return f"{x:.2f}x" if x < 1 else f"{x:.1f}x" if x < 20 else f"{x:.0f}x"


def _load(bench_dir: str, name: str) -> dict:
    with open(os.path.join(bench_dir, f"{name}.json")) as f:
        return json.load(f)


def train_table(d: dict) -> str:
    rows = [
        [r["config"], f"{r['params']:,}", f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}"]
        + [f"{r['achieved_flops_per_s'] / 1e9:.1f} G", f"{r['matmul_flops_per_s'] / 1e9:.1f} G"]
        + [f"{100 * r['mfu']:.1f}%"]
        for r in d["rows"]
    ]
    header = ["config", "params", "step (s)", "tokens/s", "model FLOP/s"]
    return _md([*header, "matmul f32 2048^3 FLOP/s", "MFU"], rows)


def _bytes(b: int) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def engram_table(d: dict) -> str:
    eng = [r for r in d["rows"] if r["kind"] == "engram"]
    ffn = [r for r in d["rows"] if r["kind"] == "dense_ffn"]
    short = {"float32": "f32", "float8_e4m3fn": "FP8", "bfloat16": "bf16"}
    rows = []
    for i, e in enumerate(eng):
        f = ffn[i] if i < len(ffn) else None
        rows.append(
            [
                f"{e['table_params']:.1e}".replace("e+0", "e"),
                f"{short[e['table_dtype']]}, {_bytes(e['table_bytes'])}",
            ]
            + [sig(e["us_per_token"]), f"{sig(e['flops_per_token'] / 1e6)} M"]
            + [sig(f["us_per_token"]) if f else "(not run)"]
            + [f"{sig(f['flops_per_token'] / 1e6)} M" if f else "(not run)"]
        )
    header = ["table params", "Engram table", "Engram us/token", "Engram FLOPs/token"]
    g = d["growth"]
    growth = (
        f"\n\nLast / first row: Engram {g['engram_time_growth']:.2f}x the time per token for "
        f"{g['engram_param_growth']:,.0f}x the table; FFN {g['ffn_time_growth']:.0f}x for "
        f"{g['ffn_param_growth']:.0f}x the parameters."
    )
    return _md([*header, "FFN us/token", "FFN FLOPs/token"], rows) + growth


BANDWIDTH_NAMES = {
    "jnp.take": "`jnp.take`",
    "xla engram_lookup": "`engram_lookup` (XLA, cache-line touch pass)",
    "host numpy x1": "`HostTable`, numpy, 1 thread",
    "host numpy x2": "`HostTable`, numpy, 2 threads",
}


ROW_BYTES = 128  # one row of the bench's Engram table: head dim 32, f32


def bandwidth_table(d: dict) -> str:
    bw = {r["path"]: r for r in d["bandwidth"]}
    memcpy = d["bandwidth"][0]["memcpy_gb_per_s"]
    rows = [
        [name, f"{bw[p]['gb_per_s']:.3f}", f"{100 * bw[p]['fraction_of_memcpy']:.1f}%"]
        for p, name in BANDWIDTH_NAMES.items()
        if p in bw
    ]
    table = _md(["path", "GB/s gathered", f"fraction of memcpy ({memcpy:.2f} GB/s)"], rows)
    x, t = bw["xla engram_lookup"], bw["jnp.take"]
    rows_m = x["table_bytes"] / ROW_BYTES / 1e6
    return table + (
        f"\n\nTable {x['table_bytes']:,} B ({rows_m:.1f} M rows of {ROW_BYTES} B), "
        f"{x['gathered_bytes'] / 2**20:.0f} MiB gathered per call; `engram_lookup` / "
        f"`jnp.take`: {x['gb_per_s'] / t['gb_per_s']:.2f}x."
    )


def verify_table(d: dict) -> str:
    by_v: dict[int, dict] = {}
    for r in d["rows"]:
        by_v.setdefault(r["V"], {})[r["variant"]] = r
    rows = []
    for v, rs in sorted(by_v.items()):
        b = rs["bound"]
        cells = [f"{v:,}", f"{sig(b['ms'])} ms ({b['read_GBps']:.1f} GB/s)"]
        cells += [
            f"{sig(rs[n]['ms'])} ms ({ratio(rs[n]['ratio_to_bound'])})"
            for n in ("xla", "race_row", "common")
        ]
        rows.append(cells)
    header = ["V", "bound (read p and q)", "xla", "race_row", "common (race at every position)"]
    return _md(header, rows)


def mhc_tables(d: dict) -> str:
    xla = [r for r in d["rows"] if "pallas" not in r["variant"]]
    rows = [
        [r["variant"], r["dtype"], f"{r['bytes_per_token']:,.0f}"]
        + [f"{r['analytic_bytes_per_token']:,.0f}", f"{r['bound_bytes_per_token']:,.0f}"]
        + [f"{r['ratio_to_bound']:.2f}", sig(r["us_per_token"])]
        + ["-" if r["variant"] == "plain" else f"{r['overhead_vs_plain']:.0f}x"]
        for r in xla
    ]
    header = ["variant", "dtype", "bytes/token (XLA)", "analytic", "bound", "ratio to bound"]
    first = _md([*header, "us/token", "overhead vs plain"], rows)
    names = {"single_pass_pallas_tpu": "TPU (Mosaic)", "single_pass_pallas_gpu": "GPU (Triton)"}
    rows = [
        [names[r["variant"]], r["dtype"], f"{r['C']:,}", f"{r['block_tokens']} x {r['block_c']}"]
        + [f"{r['bytes_per_token']:,.0f}", f"{r['bound_bytes_per_token']:,.0f}"]
        + [f"{r['ratio_to_bound']:.3f}"]
        for r in d["rows"]
        if r["variant"] in names
    ]
    header = ["kernel", "dtype", "C", "block tokens x C tile", "bytes/token (block specs)"]
    return first + "\n\n" + _md([*header, "bound", "ratio to bound"], rows)


def attention_tables(d: dict) -> str:
    impls = ["reference", "blockwise", "auto", "dot_product", "splash"]
    ms = {(r["impl"], r["T"]): r["fwd_bwd_ms"] for r in d["op_timing"]}
    lengths = sorted({t for _, t in ms})
    rows = [
        [f"{t:,}"] + [f"{sig(ms[(i, t)])} ms" if (i, t) in ms else "(not run)" for i in impls]
        for t in lengths
    ]
    header = ["T", "reference", "blockwise", "auto (= blockwise)", "dot_product (XLA)"]
    first = _md([*header, "splash (interpreted)"], rows)
    steps = sorted({int(k[9:]) for r in d["train_step_memory"] for k in r if k[:9] == "temp_MiB@"})
    rows = []
    for r in d["train_step_memory"]:
        name = r["impl"] + (" (default)" if r["impl"] == "auto" else "")
        rows.append(
            [name, *(f"{sig(r[f'temp_MiB@{t}'])} MiB" for t in steps)]
            + [f"{r[k]:.3g}x" for k in r if k.startswith("ratio_")]
        )
    header = ["impl", *(f"T = {t:,}" for t in steps)]
    header += [f"temp({b}) / temp({a})" for a, b in zip(steps, steps[1:], strict=False)]
    return first + "\n\n" + _md(header, rows)


def compile_table(d: dict) -> str:
    def rel(x: float) -> str:
        return f"{x:.3f}" if x < 2 else f"{x:.2f}"

    rows = [
        [r["layers"], r["scan"], sig(r["lower_s"]), sig(r["compile_s"]), sig(r["total_s"])]
        + [f"{r['total_vs_shallowest']:.2f}", f"{r['stablehlo_chars']:,}", f"{r['hlo_chars']:,}"]
        + [rel(r["hlo_vs_shallowest"])]
        for r in d["rows"]
    ]
    header = ["layers", "scan", "lower (s)", "compile (s)", "total (s)", "total vs 4 layers"]
    return _md([*header, "StableHLO chars", "HLO chars", "HLO vs 4 layers"], rows)


def table_file_table(d: dict) -> str:
    def opt(x, fmt):
        return "" if x is None else format(x, fmt)

    rows = [
        [f"{r['table_gib']:g}", r["path"], r["dist"], r["threads"], sig(r["ms_per_step"])]
        + [f"{r['rows_per_s']:,.0f}", f"{r['tokens_per_s']:,.0f}", opt(r.get("id_hit_rate"), ".3f")]
        + [opt(r.get("majflt_per_step"), ",.0f"), opt(r.get("minflt_per_step"), ",.0f")]
        + [opt(r.get("ideal_row_cache_hit_rate"), ".3f")]
        for r in d["rows"]
    ]
    header = ["table GiB", "path", "ids", "threads", "ms/step", "rows/s", "tokens/s"]
    header += ["id hit rate", "majflt/step", "minflt/step", "ideal row cache"]
    return _md(header, rows)


def tables_table(d: dict) -> str:
    rows = [
        [r["optimizer"], f"{r['table_params']:.2e}", sig(r["table_MiB"]), sig(r["opt_state_MiB"])]
        + [f"{1e3 * r['s_per_step']:.1f}", f"{r['vs_smallest']:.2f}"]
        for r in d["rows"]
    ]
    header = ["table optimizer", "table params", "table MiB", "optimizer state MiB"]
    out = _md([*header, "ms/step", "vs smallest table"], rows)
    skipped = [f"{s['optimizer']} at {s['size']:.0e}" for s in d.get("skipped", [])]
    return out + (f"\n\nnot run (memory or --dense-max): {', '.join(skipped)}" if skipped else "")


def host_decode_table(d: dict) -> str:
    m = d["model"]
    rows = [
        [f"{m['layers']} x {m['d_model']}", r["batch"], r["placement"]]
        + [f"{r['ms_per_token_step']:.2f}", f"{r['tokens_per_s']:,.0f}"]
        + [f"{r['best_tokens_per_s']:,.0f}", f"{r['extra_ms_per_step']:+.2f}"]
        + [f"{r['ratio']:.3f}", "yes" if r["same_tokens"] else "NO"]
        for r in d["rows"]
    ]
    header = ["layers x d", "batch", "tables", "ms/step", "tokens/s", "best tokens/s"]
    header += ["extra ms/step", "vs device", "same tokens"]
    return _md(header, rows)


def kernel_bytes_table(d: dict) -> str:
    rows = [
        [r["kernel"], r["case"], r["unit"], f"{r['bound_bytes']:,.0f}", f"{r['model_bytes']:,.0f}"]
        + [f"{r['kernel_bytes']:,.0f}", f"{r['program_bytes']:,.0f}"]
        + [f"{r['model_over_bound']:.2f}", f"{r['program_over_bound']:.2f}"]
        + [f"{r['scoped_vmem_mib']:.2f}"]
        for r in d["rows"]
    ]
    header = ["kernel", "case", "per", "bound B", "kernel's model B", "Mosaic call B"]
    header += ["program B (cost_analysis)", "model / bound", "program / bound", "VMEM MiB"]
    return _md(header, rows)


def mhc_train_cpu_table(d: dict) -> str:
    """The train step per width and form on this machine, and its overhead over plain."""
    ms = lambda r: f"{1e3 * r['step_s']:,.1f}"  # noqa: E731
    rows = [
        [f"{r['d_model']:,}", r["form"], ms(r)]
        + ["-" if r["form"] == "plain" else f"{100 * r['overhead']:+.1f}%"]
        for r in d["cpu"]
    ]
    return _md(["d", "form", "step ms (median)", "overhead vs plain (median ratio)"], rows)


def mhc_train_tpu_table(d: dict) -> str:
    """mHC's added bytes per token per sub-layer on the compiled TPU step, whole and marginal,
    against the forward + backward bound, and the marginal by part (kB)."""
    kb = lambda x: f"{x / 1e3:,.1f}"  # noqa: E731
    parts = ("mhc_kernels", "mhc_xla", "sublayers", "model_other", "compiler_inserted")
    rows = [
        [f"{r['d_model']:,}", kb(r["bound_per_token_sublayer"])]
        + [kb(r["added_bytes_per_token_sublayer"]), f"{r['added_over_bound']:.2f}"]
        + [kb(r["marginal_bytes_per_token_sublayer"]), f"{r['marginal_over_bound']:.2f}"]
        + [kb(r["marginal_by_part"][p]) for p in parts]
        for r in d["tpu"]
    ]
    lo, hi = d["tpu"][0]["layers"]
    header = ["d", "bound kB", f"added kB ({lo} layers)", "/ bound"]
    header += [f"marginal kB ({lo} -> {hi})", "/ bound", "kernels", "mHC XLA", "sub-layers"]
    return _md([*header, "other model", "compiler copies"], rows)


SECTIONS = (
    ("train", "Training throughput", train_table),
    ("engram", "Engram vs an equal-parameter dense FFN", engram_table),
    ("engram", "Lookup bandwidth", bandwidth_table),
    ("verify", "Speculative verification", verify_table),
    ("mhc", "mHC residual path", mhc_tables),
    ("mhc_train", "mHC train-step overhead on this machine", mhc_train_cpu_table),
    ("mhc_train_tpu", "mHC train-step bytes compiled for TPU", mhc_train_tpu_table),
    ("kernel_bytes", "Kernel bytes from the TPU compiler", kernel_bytes_table),
    ("attention", "Attention implementations", attention_tables),
    ("compile", "Compile time vs depth", compile_table),
    ("table_file", "Engram tables in a file", table_file_table),
    ("tables", "Train step vs Engram table size", tables_table),
    ("tables_rowwise_1e9", "Train step, 1e6 vs 1e9 table, rowwise_adagrad", tables_table),
    ("host_decode", "Decoding with host and file tables", host_decode_table),
    ("host_decode_deep", "Decoding with host and file tables, a deeper model", host_decode_table),
    ("host_decode_deep_b8", "The deeper model at batch 8, a second run", host_decode_table),
)


def render_tables(bench_dir: str = HERE) -> str:
    """Every benchmark table, from `<bench_dir>/<name>.json` alone."""
    parts = ["# Benchmark tables (rendered by experiments/benchmarks/report.py)"]
    for name, title, fn in SECTIONS:
        parts.append(f"## {title} (`{name}.json`)\n\n{fn(_load(bench_dir, name))}")
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    bench_dir = sys.argv[1] if len(sys.argv) > 1 else HERE
    text = render_tables(bench_dir)
    os.makedirs(os.path.join(bench_dir, "results"), exist_ok=True)
    with open(os.path.join(bench_dir, "results", "tables.md"), "w") as f:
        f.write(text)
    print(text)
