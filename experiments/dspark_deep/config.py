"""DSpark in its regime: a deep, weight-bound target against drafters of 1 to 3 blocks.

The target is 24 layers at d = 384 (the `small` family's tokenizer and corpus, BPE 4096);
a plain decode step of it costs ~16x a drafter block, which is the draft/target cost ratio
of the published setups (3-5 drafter layers against 36-61 target layers). It trains on the
speeches before SPLIT_YEAR of the bundled corpus, with short sequences (the decode cost does
not depend on the training sequence length, and short sequences buy steps on this CPU).
The budgets (target and drafter steps, samples, prompts, batches) are sized so that the
whole command, training included, runs in about two hours on a 2-core CPU.
`QUICK` shrinks everything for the slow smoke test.
"""

import dataclasses

from v41jax.config import Config, get_config, override

BASE = "small"  # tokenizer, data and optimizer defaults; the model is deepened below
SPLIT_YEAR = 1946
TARGET_STEPS = 180
TARGET = [
    "model.d_model=384",
    "model.num_layers=24",
    "model.num_heads=6",
    "model.num_kv_heads=6",
    "model.d_ff=1024",
    "data.seq_len=128",
    "data.global_batch_size=16",
    "optim.lr=1.5e-3",
    "optim.warmup_steps=40",
    "train.log_every=10",
    "train.eval_every=180",
    "train.eval_batches=8",
    "train.checkpoint_every=20",
]
SEED = 0


def target_config(early_dir: str) -> Config:
    cfg = override(
        get_config(BASE), [f"data.paths={early_dir}", f"train.steps={TARGET_STEPS}", *TARGET]
    )
    return dataclasses.replace(cfg, name="dspark_deep_target")


# The target's own text (`v41jax.dspark.train.self_text.write_target_samples`): continuations of
# 16-token windows of its training text at temperature 1 (~115k new tokens).
SELF_TEXT = dict(num_samples=1024, prompt_len=16, new_tokens=112, temperature=1.0, batch_size=128)
# name -> `--set` overrides of DrafterRunConfig (defaults: DSpark, K = 5, 3 blocks, r = 32,
# the hidden-state confidence head); all train DRAFTER_STEPS on the target's own text.
DRAFTERS = {
    "mtp1": [
        "drafter.kind=mtp1",
        "drafter.block_size=1",
        "drafter.num_layers=1",
        "drafter.markov_rank=0",
    ],
    "parallel": ["drafter.kind=parallel", "drafter.markov_rank=0"],
    "dspark": [],
    "dspark_1block": ["drafter.num_layers=1"],
    "dspark_r256": ["drafter.markov_rank=256"],
    "dspark_prev": ["drafter.confidence_input=prev_token"],
}
DRAFTER_STEPS = 300
# 3 validation batches: the held-out part of the target's 1024 samples holds 51 sequences
DRAFTER_COMMON = [
    "train.eval_every=0",
    "train.eval_batches=3",
    "train.log_every=25",
    "train.checkpoint_every=50",
]
MAIN = "dspark"  # the drafter of the scheduler study
# Wall-clock decoders: (label, drafter or None, mode). Each runs at every batch of BATCHES
# and temperature of TEMPERATURES, in TIMING_PASSES interleaved passes.
DECODERS = (
    ("plain", None, None),
    ("mtp1", "mtp1", "fixed"),
    ("parallel", "parallel", "fixed"),
    ("dspark fixed", "dspark", "fixed"),
    ("dspark scheduled", "dspark", "scheduled"),
    ("dspark r256 fixed", "dspark_r256", "fixed"),
)
BATCHES = (1, 4, 8, 32)
# The round-cost tables (c and v(L)) of every drafter are measured at these batches; those of
# the scheduled drafters, which the scheduler needs, at every batch of BATCHES.
COSTS_OF_EVERY_DRAFTER_AT = ()
# `measure_round_cost`: rounds timed per width and pass, timed passes (min taken) after the
# one that compiles; 8 rounds of a 24-layer target are >= 0.2 s even at batch 1.
COST_ROUNDS = 8
COST_PASSES = 2
# prompts decoded per batch size (a pass decodes them all in chunks of the batch size)
PROMPTS = {1: 4, 4: 8, 8: 16, 32: 32}
PROMPT_LEN = 32
NEW_TOKENS = 64
TEMPERATURES = (1.0, 0.0)
TIMING_PASSES = 3
# The scheduler vs every fixed length and plain decoding at these batches, SCHED_PASSES
# interleaved passes; the replay prices every policy and the oracle bound on REPLAY_PASSES
# decodes at fixed K.
SCHED_BATCHES = (32,)
SCHED_PASSES = 3
REPLAY_PASSES = 2

QUICK = dict(
    BASE="tiny",
    TARGET_STEPS=6,
    TARGET=["train.checkpoint_every=3", "train.eval_batches=1"],
    SELF_TEXT=dict(
        num_samples=48,
        prompt_len=8,
        new_tokens=40,
        temperature=1.0,
        batch_size=48,
        samples_per_file=12,
    ),  # fmt: skip
    DRAFTERS={"mtp1": DRAFTERS["mtp1"], "dspark": [], "dspark_prev": DRAFTERS["dspark_prev"]},
    DRAFTER_STEPS=3,
    # 8 rows: the drafter batch is split over the 8 fake devices of the tests
    DRAFTER_COMMON=DRAFTER_COMMON + ["train.batch_size=8", "train.eval_batches=1"],
    DECODERS=(
        ("plain", None, None),
        ("mtp1", "mtp1", "fixed"),
        ("dspark fixed", "dspark", "fixed"),
        ("dspark scheduled", "dspark", "scheduled"),
        ("dspark prev-token scheduled", "dspark_prev", "scheduled"),
    ),
    BATCHES=(1, 4),
    COSTS_OF_EVERY_DRAFTER_AT=(1,),
    COST_ROUNDS=2,
    COST_PASSES=1,
    PROMPTS={1: 2, 4: 4},
    PROMPT_LEN=8,
    NEW_TOKENS=8,
    TIMING_PASSES=1,
    SCHED_BATCHES=(4,),
    SCHED_PASSES=1,
    REPLAY_PASSES=1,
)
