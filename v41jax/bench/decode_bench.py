"""Plain decoding (`generate`) vs a bare forward loop over the same KV cache, per new token.

`bare` is the least a decoder can do: one jit holding the prompt's forward through a fresh
cache and a `lax.scan` of 1-token `Transformer.apply` calls through it, each followed by the
argmax (greedy) or `jax.random.categorical` (temperature 1) of the logits. The prefill is
inside it because `generate` has one too, so ms/token of both counts the same work
(`--new-tokens` tokens after a `--prompt`-token prompt, every row full length).
Variants per batch: `bare_greedy`, `bare_t1`, `generate_greedy` (temperature 0),
`generate_t1` (temperature 1; its top-k / top-p / min-p off). They run interleaved: every
variant once per pass, all batches in each pass, so a drift in the machine's speed hits all
of them alike; the fastest and median pass are reported, and `ratio_vs_bare` = generate's
fastest ms/token over the bare loop's of the same batch and sampling (greedy vs greedy,
temperature 1 vs temperature 1), measured side by side in one run;
`ratio_vs_bare_paired_median` the median over passes of generate's time over the bare
loop's in the same pass (`ms_per_token_passes` has every pass).

    python -m v41jax.bench decode --json experiments/benchmarks/decode.json
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.bench.common import (
    format_table,
    machine_info,
    positive_int,
    time_interleaved,
    write_json,
)
from v41jax.config import ModelConfig
from v41jax.decode import SamplingParams, generate, init_cache
from v41jax.model import Transformer, init_params

VARIANTS = ("bare_greedy", "generate_greedy", "bare_t1", "generate_t1")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=24)
    p.add_argument("--d-model", type=positive_int, default=384)
    p.add_argument("--vocab", type=positive_int, default=4096)
    p.add_argument("--batches", default="1,4,8,32", help="batch sizes, comma list")
    p.add_argument("--prompt", type=positive_int, default=8, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per call")
    p.add_argument("--max-seq-len", type=positive_int, default=256, help="KV-cache slots")
    p.add_argument("--passes", type=positive_int, default=5)
    p.add_argument("--json", default=None)


def model_config(args) -> ModelConfig:
    """A plain (no Engram, no MoE) model of `--layers` x `--d-model`: heads of 32."""
    d = args.d_model
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=d,
        num_layers=args.layers,
        num_heads=max(d // 32, 1),
        num_kv_heads=max(d // 64, 1),
        d_ff=4 * d,
        max_seq_len=max(args.max_seq_len, args.prompt + args.new_tokens),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "new_tokens", "greedy"))
def bare_decode(params, cfg: ModelConfig, prompts_BxP, rng, *, new_tokens: int, greedy: bool):
    """int32 [B, new_tokens]: prefill the full-length prompts [B, P], then a scan of 1-token
    forwards through the cache, each picking argmax or a categorical draw of its logits."""
    b, p = prompts_BxP.shape
    model = Transformer(cfg)

    def pick(key, logits_BxV):
        if greedy:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)

    out = model.apply(
        {"params": params},
        prompts_BxP,
        cache=init_cache(cfg, b),
        cache_index=jnp.zeros((b,), jnp.int32),
    )
    rng, key = jax.random.split(rng)
    first_B = pick(key, out.logits[:, -1])

    def step(carry, key):
        cache, tok_B, pos_B = carry
        out = model.apply(
            {"params": params}, tok_B[:, None], pos_B[:, None], cache=cache, cache_index=pos_B
        )
        tok_B = pick(key, out.logits[:, 0])
        return (out.cache, tok_B, pos_B + 1), tok_B

    start = jnp.full((b,), p, jnp.int32)
    keys = jax.random.split(rng, new_tokens - 1)
    _, rest_NxB = jax.lax.scan(step, (out.cache, first_B, start), keys)
    return jnp.concatenate([first_B[:, None], rest_NxB.T], axis=1)


def variant_calls(params, cfg: ModelConfig, prompts_BxP: np.ndarray, new_tokens: int) -> dict:
    """{variant: () -> int32 [B, new_tokens]} for one batch of prompts."""
    lengths = np.full((prompts_BxP.shape[0],), prompts_BxP.shape[1], np.int32)
    rng = jax.random.key(1)
    prompts = jnp.asarray(prompts_BxP)

    def gen(temperature):
        return lambda: generate(
            params,
            cfg,
            prompts,
            lengths,
            max_new_tokens=new_tokens,
            sampling=SamplingParams(temperature=temperature),
            rng=rng,
        )

    def bare(greedy):
        return lambda: bare_decode(params, cfg, prompts, rng, new_tokens=new_tokens, greedy=greedy)

    return {
        "bare_greedy": bare(True),
        "generate_greedy": gen(0.0),
        "bare_t1": bare(False),
        "generate_t1": gen(1.0),
    }


def run(args) -> int:
    cfg = model_config(args)
    params = init_params(cfg, jax.random.key(0))
    batches = [int(x) for x in args.batches.split(",")]
    calls, same_greedy = {}, {}
    for b in batches:
        prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, args.prompt))
        calls[b] = variant_calls(params, cfg, prompts.astype(np.int32), args.new_tokens)
        outs = {k: np.asarray(f()) for k, f in calls[b].items()}  # compile
        # random weights give near-tied logits, so greedy equality is a sanity check only
        same_greedy[b] = bool(np.array_equal(outs["bare_greedy"], outs["generate_greedy"]))
    times = time_interleaved(
        {(b, k): calls[b][k] for b in batches for k in VARIANTS}, passes=args.passes
    )
    rows = []
    for b in batches:
        for k in VARIANTS:
            ts = [1e3 * t / args.new_tokens for t in times[b, k]]
            bare_ts = times[b, "bare_" + k.split("_")[1]]
            # per pass, against the bare loop timed next to it: robust to the machine's drift
            paired = [t / t_bare for t, t_bare in zip(times[b, k], bare_ts, strict=True)]
            rows.append(
                dict(
                    batch=b,
                    variant=k,
                    ms_per_token_fastest=min(ts),
                    ms_per_token_median=statistics.median(ts),
                    ratio_vs_bare=min(ts) / (1e3 * min(bare_ts) / args.new_tokens),
                    ratio_vs_bare_paired_median=statistics.median(paired),
                    ms_per_token_passes=ts,
                    same_greedy_tokens=same_greedy[b],
                )
            )
    cols = ["batch", "variant", "ms_per_token_fastest", "ms_per_token_median", "ratio_vs_bare"]
    print(format_table(rows, [*cols, "ratio_vs_bare_paired_median", "same_greedy_tokens"]))
    write_json(
        args.json,
        {
            "benchmark": "decode",
            "machine": machine_info(),
            "args": vars(args),
            "model": {
                "layers": cfg.num_layers,
                "d_model": cfg.d_model,
                "vocab": cfg.vocab_size,
                "num_heads": cfg.num_heads,
                "num_kv_heads": cfg.num_kv_heads,
                "max_seq_len": cfg.max_seq_len,
            },
            "rows": rows,
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m v41jax.bench decode", description=__doc__)
    add_args(parser)
    return run(parser.parse_args(argv))
