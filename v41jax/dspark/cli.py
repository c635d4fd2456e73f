"""`python -m v41jax generate --drafter D`: the CLI's DSpark decoding path (kept here so the
command-line module stays small)."""

from __future__ import annotations

import sys

import jax
import numpy as np

from v41jax.dspark.decode.engine import dspark_generate, load_or_measure_cost
from v41jax.dspark.model.drafter import frozen_target
from v41jax.dspark.train.load import load_drafter


def generate_with_drafter(args, run, padded, lengths, max_new, sampling, seed):
    """`generate --drafter`: DSpark speculative decoding of `padded` int32 [B, P] prompts
    (`lengths` int32 [B]) with the drafter in `args.drafter`; returns the tokens [B, max_new].
    Prints the mean tokens per verify round to stderr."""
    dcfg, dparams, _ = load_drafter(args.drafter, target=run)
    cost = None
    if args.schedule == "scheduled":
        cost = load_or_measure_cost(
            args.drafter,
            run.params,
            run.cfg.model,
            dparams,
            dcfg.drafter,
            len(lengths),
            compression=run.compression.table,
            verify=args.verify,
        )
    out = dspark_generate(
        run.params,
        run.cfg.model,
        dparams,
        dcfg.drafter,
        frozen_target(run.params, run.cfg.model),
        padded,
        lengths,
        max_new_tokens=max_new,
        mode=args.schedule,
        verify_len=args.verify_len,
        cost=cost,
        rng=jax.random.PRNGKey(seed),
        compression=run.compression.table,
        sampling=sampling,
        verify=args.verify,
    )
    active = np.asarray(out.active)
    emitted = (np.asarray(out.accepted) + 1)[active].sum()
    print(
        f"drafter {args.drafter}: {emitted / max(active.sum(), 1):.2f} tokens per round "
        f"({args.schedule}, {args.verify})",
        file=sys.stderr,
    )
    return out.tokens
