"""Train-step time against Engram table size, per table optimizer (`optim.table_optimizer`).

The same small model (the `tiny` backbone, one Engram layer) with tables from 1e6 to 1e9
parameters: a dense step (`adam`) reads, differentiates and rewrites the whole table and its
two moments every step, so its time grows with the table; a row-sparse step (`sparse_adam`,
`rowwise_adagrad`) touches only the B T H rows the batch reads, so its time should not. For
each (optimizer, size): median seconds per step after compilation, the ratio to the same
optimizer's smallest table, and the bytes of the table and of its optimizer state (from the
abstract train state). Sizes whose state would not fit in this machine's memory are skipped
and say so.

Batches are synthetic: random tokens, and per head Zipf-distributed hash ids (like n-gram
ids of real text); the step's cost does not depend on their values beyond how many distinct
rows they hit.

    python -m v41jax.bench tables --json experiments/benchmarks/tables.json
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from v41jax import config as config_lib
from v41jax.bench.common import format_table, machine_info, time_call, write_json
from v41jax.engram import table_optim
from v41jax.engram.primes import layer_primes
from v41jax.model import engram_ids_key
from v41jax.sharding import make_mesh
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step

HEAD_DIM, HEADS_PER_ORDER, ORDERS = 16, 4, 2  # 8 tables of 16-wide rows per layer


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1e6,1e7,1e8,5e8,1e9", help="table params, comma list")
    p.add_argument("--optimizers", default=",".join(table_optim.TABLE_OPTIMIZERS))
    p.add_argument("--dense-max", type=float, default=1e8, help="largest size for adam")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.6,
        help="skip sizes whose table + state exceed this share of RAM",
    )
    p.add_argument("--json", default=None)


def config_for(size: float, optimizer: str) -> config_lib.Config:
    vocab = max(int(size / (HEAD_DIM * HEADS_PER_ORDER * ORDERS)), 64)
    return config_lib.override(
        config_lib.get_config("tiny"),
        [
            "model.engram.layer_ids=1",
            f"model.engram.engram_vocab_size={vocab},{vocab}",
            f"model.engram.n_embed_per_ngram={HEAD_DIM * HEADS_PER_ORDER}",
            f"model.engram.n_head_per_ngram={HEADS_PER_ORDER}",
            "model.engram.compressed_vocab_size=512",
            f"optim.table_optimizer={optimizer}",
        ],
    )


def synthetic_batch(cfg: config_lib.Config, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t = cfg.data.global_batch_size, cfg.data.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.float32),
    }
    engram = cfg.model.engram
    for layer in engram.layer_ids:
        primes = np.asarray(layer_primes(engram, layer))
        ranks = rng.zipf(1.2, (b, t, len(primes))) - 1  # rank 0 = the most frequent row
        batch[engram_ids_key(layer)] = (ranks * 7919 % primes).astype(np.int32)
    return batch


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _table_bytes(abstract) -> tuple[int, int]:
    """(bytes of the tables, bytes of their optimizer state) in the abstract train state."""
    is_table = lambda path: "engram" in path and path.endswith("table']")  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
    tables = sum(_nbytes(x) for p, x in flat if is_table(jax.tree_util.keystr(p)))
    opt = jax.tree_util.tree_flatten_with_path(abstract.opt_state)[0]
    state = sum(
        _nbytes(x) for p, x in opt if "'tables'" in (k := jax.tree_util.keystr(p)) or is_table(k)
    )
    return tables, state


def measure(size: float, optimizer: str, steps: int) -> dict:
    cfg = config_for(size, optimizer)
    mesh = make_mesh(cfg.mesh)
    model, opt, init_fn, shardings, abstract = make_state_fns(cfg, mesh)
    table_b, state_b = _table_bytes(abstract)
    step = make_train_step(cfg, mesh, model, opt, shardings)
    state = init_fn(0)
    batches = [device_batch(mesh, synthetic_batch(cfg, s)) for s in range(steps + 2)]
    box = {"state": state, "i": 0}

    def one():
        box["state"], metrics = step(box["state"], batches[box["i"] % len(batches)])
        box["i"] += 1
        return metrics["loss"]

    t = time_call(one, warmup=2, iters=steps)
    box.clear()  # free the state before the next size is built
    del state
    return {
        "optimizer": optimizer,
        "table_params": table_b // 4,
        "table_MiB": table_b / 2**20,
        "opt_state_MiB": state_b / 2**20,
        "s_per_step": t["median_s"],
    }


def run(args) -> int:
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    kinds = [k for k in args.optimizers.split(",") if k.strip()]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows, skipped = [], []
    for kind in kinds:
        base = None
        for size in sizes:
            # table + state, + the init's random bits beside the table; dense Adam also holds
            # a table-sized gradient and update
            need = 2 * size * 4 + table_optim.state_bytes(kind, int(size / HEAD_DIM), HEAD_DIM)
            need += 2 * size * 4 if kind == "adam" else 0
            if (kind == "adam" and size > args.dense_max) or need > args.memory_fraction * ram:
                skipped.append({"optimizer": kind, "size": size, "bytes_needed": need})
                continue
            row = measure(size, kind, args.steps)
            base = base or row["s_per_step"]
            row["vs_smallest"] = row["s_per_step"] / base
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
            jax.clear_caches()
    cols = ["optimizer", "table_params", "table_MiB", "opt_state_MiB", "s_per_step", "vs_smallest"]
    print(format_table(rows, cols))
    for s in skipped:
        print(
            f"skipped {s['optimizer']} at {s['size']:.0e}: needs {s['bytes_needed'] / 2**30:.1f}"
            " GiB (or above --dense-max)"
        )
    write_json(
        args.json,
        {"machine": machine_info(), "rows": rows, "skipped": skipped, "steps": args.steps},
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
