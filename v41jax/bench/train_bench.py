"""Training throughput: tokens/s and model FLOP/s of a config's jitted train step, next to this
machine's dense f32 matmul FLOP/s measured in the same run, so their ratio (model FLOPs
utilisation, MFU) is side by side.

Model FLOPs per token are `v41jax.model.model_flops_per_token` (6 x matmul params + the
attention matmuls over the full T x T window, forward + backward, PaLM's MFU convention).
The batches are random token ids of the config's shape: the step's cost does not depend on
the token values, and no tokenizer needs training.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from v41jax import config as config_lib
from v41jax.bench.common import format_table, machine_info, time_call, write_json
from v41jax.model import count_params, model_flops_per_token
from v41jax.sharding import make_mesh
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=10, help="timed train steps")
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--json", default=None, help="write results here")


def matmul_flops_per_s(n: int, iters: int = 10) -> float:
    """f32 [n,n] @ [n,n] under jit: 2 n^3 FLOPs per call, median time."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    t = time_call(lambda: f(a, b), warmup=2, iters=iters)
    return 2 * n**3 / t["median_s"]


def synthetic_batch(cfg: config_lib.Config, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t = cfg.data.global_batch_size, cfg.data.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.float32),
    }


def run(args) -> int:
    cfg = config_lib.override(config_lib.get_config(args.config), args.overrides)
    mesh = make_mesh(cfg.mesh)
    model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
    state = init_fn(cfg.train.seed)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    batches = [device_batch(mesh, synthetic_batch(cfg, i)) for i in range(2)]
    holder = {"state": state, "i": 0}

    def one_step():
        holder["state"], metrics = step(holder["state"], batches[holder["i"] % 2])
        holder["i"] += 1
        return metrics["loss"]

    matmul_before = matmul_flops_per_s(args.matmul_size)
    timing = time_call(one_step, warmup=2, iters=args.steps)
    matmul_after = matmul_flops_per_s(args.matmul_size)
    # The better of the two is the ceiling: a slow reading means the machine was busy, and
    # dividing by it would flatter the model's utilisation.
    matmul = max(matmul_before, matmul_after)

    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    flops_tok = model_flops_per_token(cfg.model, cfg.data.seq_len)
    tokens_per_s = tokens / timing["median_s"]
    achieved = tokens_per_s * flops_tok
    row = {
        "config": cfg.name,
        "params": count_params(state.params),
        "tokens_per_step": tokens,
        "step_s": timing["median_s"],
        "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops_tok,
        "achieved_flops_per_s": achieved,
        "matmul_flops_per_s": matmul,
        "mfu": achieved / matmul,
    }
    cols = [
        "config",
        "params",
        "step_s",
        "tokens_per_s",
        "achieved_flops_per_s",
        "matmul_flops_per_s",
        "mfu",
    ]
    print(format_table([row], cols))
    print(
        f"matmul {args.matmul_size}^3 f32: before {matmul_before / 1e9:.1f} GFLOP/s, "
        f"after {matmul_after / 1e9:.1f} GFLOP/s"
    )
    write_json(
        args.json,
        {
            "rows": [row],
            "machine": machine_info(),
            "timing": timing,
            "matmul_before": matmul_before,
            "matmul_after": matmul_after,
        },
    )
    return 0
