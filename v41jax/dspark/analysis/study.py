"""Decoding studies: many decoders over the same prompts, timed side by side.

What an experiment comparing speculative decoders needs and a user can reuse: held-out
prompts (`val_prompts`), a `Decoder` that runs plain decoding or any drafter over every prompt
in chunks of a batch size, interleaved timing (`time_interleaved`: every decoder once per pass,
fastest and median kept, because a shared machine's speed drifts within minutes), and the
per-drafter statistics of a DSpark log (`drafter_stats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from v41jax.data import load_data
from v41jax.decode import SamplingParams, generate
from v41jax.dspark.analysis import round_logs as A
from v41jax.dspark.decode.engine import dspark_generate
from v41jax.dspark.model.drafter import frozen_target


def val_prompts(run, n: int, length: int) -> np.ndarray:
    """n prompts int32 [n, length] spread evenly over a trained run's held-out text."""
    data = load_data(run.cfg.data, tokenizer=run.tokenizer)
    tokens = np.asarray(data.val_tokens)
    if tokens.size < length + 1:
        raise ValueError(
            f"the validation text has {tokens.size} tokens, < length + 1 = {length + 1}"
        )
    starts = np.linspace(0, tokens.size - length - 1, n).astype(int)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


class Decoder:
    """Decodes every prompt [N, P] in chunks of `batch` rows with `new_tokens` new tokens.

    `run(batch, drafter=None | (run_config, params), **dspark_kw)` returns (wall seconds of one
    pass over all prompts, the merged DSpark log or None for plain decoding). Every pass uses
    the same key `seed`, so passes of one decoder differ only in time."""

    def __init__(self, target, prompts: np.ndarray, new_tokens: int, seed: int = 0):
        self.target, self.prompts, self.new_tokens, self.seed = target, prompts, new_tokens, seed
        self.frozen = frozen_target(target.params, target.cfg.model)

    def _chunks(self, batch: int):
        for i in range(0, len(self.prompts), batch):
            p = self.prompts[i : i + batch]
            yield p, np.full((len(p),), p.shape[1], np.int32)

    def call(self, p, lens, drafter=None, temperature=1.0, seed=None, **dspark_kw):
        """One chunk's output (`generate`'s tokens, or the `DSparkOutput`)."""
        t = self.target
        key = jax.random.key(self.seed if seed is None else seed)
        sampling = SamplingParams(temperature=temperature)
        common = dict(max_new_tokens=self.new_tokens, sampling=sampling, rng=key)
        if drafter is None:
            return generate(t.params, t.cfg.model, p, lens, **common)
        run_cfg, params = drafter
        return dspark_generate(
            t.params,
            t.cfg.model,
            params,
            run_cfg.drafter,
            self.frozen,
            p,
            lens,
            **common,
            **dspark_kw,
        )

    def run(self, batch: int, drafter=None, compile_first: bool = True, **kw):
        if compile_first:
            jax.block_until_ready(self.call(*next(self._chunks(batch)), drafter, **kw))
        logs, start = [], time.perf_counter()
        for p, lens in self._chunks(batch):
            out = jax.block_until_ready(self.call(p, lens, drafter, **kw))
            if drafter is not None:
                logs.append({k: np.asarray(v) for k, v in out._asdict().items()})
        return time.perf_counter() - start, (A.merge_logs(logs) if logs else None)


def time_interleaved(
    jobs: Mapping[Hashable, Callable[[bool], tuple[float, Any]]], passes: int, desc: str = "timing"
) -> dict[Hashable, dict]:
    """Run every job once per pass, in the same order each pass (the first call of a job
    compiles: `job(compile_first)` returns (seconds, payload)). Per job: the seconds of
    every timed pass, the fastest and the median, and the payload of the first pass."""
    if passes < 1:
        raise ValueError(f"passes={passes} must be >= 1")
    out = {name: {"seconds": []} for name in jobs}
    for p in tqdm(range(passes), desc=desc):
        for name, job in jobs.items():
            secs, payload = job(p == 0)
            out[name]["seconds"].append(secs)
            if p == 0:
                out[name]["payload"] = payload
    for v in out.values():
        v["fastest"], v["median"] = float(min(v["seconds"])), float(np.median(v["seconds"]))
    return out


def drafter_stats(log: dict, k: int) -> dict:
    """Acceptance per position, tokens per round (measured and modelled for fixed-length
    logs), mean verify length and confidence calibration of one merged log."""
    alpha, reached = A.acceptance_per_position(log["verify_len"], log["accepted"], log["active"], k)
    fixed_k = bool(np.all(log["verify_len"][log["active"]] == k))
    return {
        "acceptance": [None if np.isnan(a) else float(a) for a in alpha],
        "reached": reached.tolist(),
        "tokens_per_round": A.tokens_per_round(log["accepted"], log["active"]),
        "predicted_tokens_per_round": (
            A.predicted_tokens_per_round(alpha, k)
            if fixed_k and not np.isnan(alpha).any()
            else None
        ),
        "mean_verify_len": float(log["verify_len"][log["active"]].mean()),
        "calibration": A.calibration(
            log["confidence"], log["verify_len"], log["accepted"], log["active"]
        ),
    }
