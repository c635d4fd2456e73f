"""Speculative-decoding throughput validation: the Monte Carlo grid and the real-model run.

Target: the `small` config (the quickstart model). Drafter: a much smaller model with the
same tokenizer, trained on the same corpus for the same steps. `QUICK` shrinks everything
for the smoke test.
"""

import dataclasses

from v41jax.config import Config, ModelConfig, get_config

# Monte Carlo: i.i.d. per-position acceptance alpha, draft lengths k, rows per point.
ALPHAS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
DRAFT_LENGTHS = tuple(range(1, 9))
MC_ROWS = 40_000
MC_VOCAB = 12

# Real run: prompts from the validation split, continuation length, draft lengths.
NUM_PROMPTS = 8
PROMPT_LEN = 32
NEW_TOKENS = 96
REAL_DRAFT_LENGTHS = (1, 2, 3, 4, 6)
TEMPERATURES = (1.0, 0.0)
TIMING_REPEATS = 7


def target_config() -> Config:
    return dataclasses.replace(get_config("small"), name="spec_target")


def drafter_config() -> Config:
    cfg = target_config()
    model: ModelConfig = dataclasses.replace(
        cfg.model, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=192
    )
    return dataclasses.replace(cfg, name="spec_drafter", model=model)


QUICK = dict(
    ALPHAS=(0.5, 0.9),
    DRAFT_LENGTHS=(1, 3),
    MC_ROWS=4_000,
    NUM_PROMPTS=2,
    NEW_TOKENS=12,
    REAL_DRAFT_LENGTHS=(2,),
    TEMPERATURES=(1.0,),
    TIMING_REPEATS=1,
    TRAIN_STEPS=4,
)
