"""Decode tokens/s with Engram tables on the device, in host memory, and in a memory-mapped file.

One model, four placements of the same table values: `device` (a param), `host` (a
`HostTable` in RAM, read inside the decode step: `HostRows`; natively on CPU,
`v41jax.kernels.host_gather`), `host_callback` (the same table read by a `jax.pure_callback`,
the path GPU/TPU backends take) and `file` (a `TableFile` on disk, read like `host`).
`generate` decodes `--new` tokens after a `--prompt`-token prompt at each batch size; the
placements run interleaved, one call each per pass, so they share the machine's state; the
median and fastest pass are reported, and `ratio` = host (or file) tokens/s over device
tokens/s of the same batch in the same run, `extra_ms_per_step` the added time per decode
step (the host read's fixed cost).
Greedy outputs are checked equal across placements (the rows are the same bits).

    python -m v41jax.bench host_decode --json experiments/benchmarks/host_decode.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile

import jax
import numpy as np

from v41jax.bench.common import (
    format_table,
    machine_info,
    positive_int,
    time_interleaved,
    write_json,
)
from v41jax.config import ModelConfig
from v41jax.decode import generate
from v41jax.engram import EngramConfig
from v41jax.engram.host_rows import HostRows
from v41jax.engram.host_table import HostTable
from v41jax.engram.table_file import create_table_file
from v41jax.model import init_params
from v41jax.model.host_params import engram_tables, tables_on_host

PLACEMENTS = ("device", "host", "host_callback", "file")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8", help="batch sizes, comma list")
    p.add_argument("--table-params", type=float, default=5e7, help="per Engram layer")
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--engram-layers", default="2,5", help="comma list")
    p.add_argument("--prompt", type=positive_int, default=16)
    p.add_argument("--new", type=positive_int, default=64, help="new tokens per call")
    p.add_argument("--passes", type=positive_int, default=7)
    p.add_argument("--file-dir", default=None, help="where the table files go (default tmp)")
    p.add_argument("--quick", action="store_true", help="3 passes of 16 tokens, 1e6 tables")
    p.add_argument("--json", default=None)


def model_config(args) -> ModelConfig:
    layer_ids = tuple(int(x) for x in args.engram_layers.split(","))
    head_dim, heads = 32, 4  # per order: 4 heads of 32; orders 2 and 3 -> 8 tables a layer
    vocab = max(int(args.table_params / (head_dim * heads * 2)), 64)
    engram = EngramConfig(
        engram_vocab_size=(vocab, vocab),
        max_ngram_size=3,
        n_embed_per_ngram=head_dim * heads,
        n_head_per_ngram=heads,
        layer_ids=layer_ids,
        compressed_vocab_size=2048,
    )
    d = args.d_model
    return ModelConfig(
        vocab_size=4096,
        d_model=d,
        num_layers=args.layers,
        num_heads=d // 32,
        num_kv_heads=max(d // 64, 1),
        d_ff=4 * d,
        engram=engram,
        max_seq_len=args.prompt + args.new + 8,
    )


def placements(params, cfg: ModelConfig, file_dir: str) -> dict:
    """{placement: params}: the device params, and the same tables on the host and in files."""
    tables = {layer: np.asarray(t) for layer, t in engram_tables(params).items()}
    files = {}
    for layer, t in tables.items():
        tf = create_table_file(os.path.join(file_dir, f"layer_{layer}"), *t.shape, progress=False)
        for a in range(0, t.shape[0], 1 << 18):
            ids = np.arange(a, min(a + (1 << 18), t.shape[0]))
            tf.update_rows(ids, t[ids])
        tf.flush()
        files[layer] = tf
    return {
        "device": params,
        "host": tables_on_host(params, cfg, {k: HostTable(v) for k, v in tables.items()}),
        "host_callback": tables_on_host(
            params, cfg, {k: HostRows(HostTable(v), allow_native=False) for k, v in tables.items()}
        ),
        "file": tables_on_host(params, cfg, files),
    }


def run(args) -> int:
    if args.quick:
        args.passes, args.new, args.table_params = 3, 16, 1e6
    cfg = model_config(args)
    params = init_params(cfg, jax.random.key(0))
    compression = (np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size).astype(np.int32)
    table_bytes = sum(t.nbytes for t in engram_tables(params).values())
    rows = []
    with tempfile.TemporaryDirectory(dir=args.file_dir) as tmp:
        by_place = placements(params, cfg, tmp)
        for b in (int(x) for x in args.batches.split(",")):
            rng = np.random.default_rng(b)
            prompts = rng.integers(0, cfg.vocab_size, (b, args.prompt)).astype(np.int32)
            lengths = np.full((b,), args.prompt, np.int32)

            def call(p, prompts=prompts, lengths=lengths):
                return generate(
                    p, cfg, prompts, lengths, max_new_tokens=args.new, compression=compression
                )

            outs = {k: np.asarray(call(p)) for k, p in by_place.items()}  # compile + check
            same = all(np.array_equal(outs["device"], o) for o in outs.values())
            times = time_interleaved(
                {k: functools.partial(call, p) for k, p in by_place.items()}, passes=args.passes
            )
            dev = statistics.median(times["device"])
            for k, ts in times.items():
                med = statistics.median(ts)
                rows.append(
                    dict(
                        batch=b,
                        placement=k,
                        ms_per_token_step=1e3 * med / args.new,
                        tokens_per_s=b * args.new / med,
                        best_tokens_per_s=b * args.new / min(ts),
                        extra_ms_per_step=1e3 * (med - dev) / args.new,
                        ratio=dev / med,
                        same_tokens=same,
                    )
                )
    cols = [
        "batch",
        "placement",
        "ms_per_token_step",
        "tokens_per_s",
        "best_tokens_per_s",
        "extra_ms_per_step",
        "ratio",
        "same_tokens",
    ]
    print(format_table(rows, cols))
    write_json(
        args.json,
        {
            "benchmark": "host_decode",
            "machine": machine_info(),
            "args": vars(args),
            "model": {
                "layers": cfg.num_layers,
                "d_model": cfg.d_model,
                "engram_layers": list(cfg.engram.layer_ids),
                "table_bytes": table_bytes,
            },
            "rows": rows,
        },
    )
    return 0 if all(r["same_tokens"] for r in rows) else 1
