"""DSpark experiment settings: the target, its post-training stand-in, the drafters, the eval.

Text: the bundled State of the Union corpus split by year. The target trains on speeches
before SPLIT_YEAR; its "post-training" stand-in continues training on the speeches from
SPLIT_YEAR on (modern prose: a real shift of the target's distribution), with the same
tokenizer. Drafters train on the target's text; evaluation prompts come from the held-out
validation split of the text the target in question was (last) trained on.
`QUICK` shrinks everything for the slow smoke test.
"""

import dataclasses

from v41jax.config import Config, get_config, override

BASE = "small"  # the named config of the target
SPLIT_YEAR = 1946
TARGET_STEPS = 400
POST_STEPS = 100
DRAFTER_STEPS = 900
ABLATION_STEPS = 300  # the ablations are compared among themselves, at 300 steps
REALIGN_STEPS = 150

# name -> `--set` overrides of DrafterRunConfig (defaults: DSpark, K = 5, 3 blocks, r = 32).
DRAFTERS = {
    "mtp1": [
        "drafter.kind=mtp1",
        "drafter.block_size=1",
        "drafter.num_layers=1",
        "drafter.markov_rank=0",
    ],
    "parallel": ["drafter.kind=parallel", "drafter.markov_rank=0"],
    "dspark": [],
}
# DRAFTERS train DRAFTER_STEPS on the target's own samples (SELF_TEXT). ABLATIONS train
# ABLATION_STEPS and are evaluated for acceptance only (batch max(BATCHES), fixed K):
# `*_s300` are DRAFTERS at 300 steps on the same text (the references; also what 3x longer
# training buys), `*_corpus` the same on the target's corpus instead (the training-data
# choice), `dspark_tokens` one-hot corpus tokens as targets instead of the target's
# distributions, `dspark_ctx_s300` the contextual Markov head (drafter.markov_context),
# `dspark_k7_s300` K = 7 (the public checkpoints' block size).
ABLATIONS = {
    "dspark_s300": [],
    "mtp1_s300": DRAFTERS["mtp1"],
    "parallel_s300": DRAFTERS["parallel"],
    "dspark_ctx_s300": ["drafter.markov_context=128"],
    "dspark_k7_s300": ["drafter.block_size=7"],
    "dspark_corpus": [],
    "mtp1_corpus": DRAFTERS["mtp1"],
    "parallel_corpus": DRAFTERS["parallel"],
    "dspark_tokens": ["train.targets=tokens"],
}
SELF_TEXT_ABLATIONS = (
    "dspark_s300",
    "mtp1_s300",
    "parallel_s300",
    "dspark_ctx_s300",
    "dspark_k7_s300",
)
# The target's own text (`v41jax.dspark.train.self_text.write_target_samples`): continuations of
# 16-token windows of its training text at temperature 1, ~490k new tokens.
SELF_TEXT = dict(num_samples=2048, prompt_len=16, new_tokens=240, temperature=1.0, batch_size=64)
DRAFTER_COMMON = ["train.eval_every=0", "train.log_every=25"]
MAIN = "dspark"  # the drafter of the scheduler, fixed-length sweep and realignment studies

NUM_PROMPTS = 32
PROMPT_LEN = 32
NEW_TOKENS = 64
BATCHES = (1, 8, 32)
TEMPERATURE = 1.0
TIMING_REPEATS = 3  # interleaved passes over every decoder; the fastest counts
# Acceptance-only study at batch max(BATCHES): every drafter of DRAFTERS at each temperature
# (0 = greedy: drafts are the argmax of q and the verifier's q is one-hot).
TEMPERATURES = (0.0, 0.5, 1.0)
# The scheduler vs each fixed length at batch max(BATCHES): SCHED_REPEATS interleaved passes
# (every configuration once per pass), medians compared (the machine's speed drifts).
SCHED_REPEATS = 5
# Replay (`v41jax.dspark.train.replay`): REPLAY_PASSES decodes at fixed K, batch max(BATCHES), seeds
# SEED, SEED + 1, ..., whose rounds every width policy and the oracle bound are priced on.
REPLAY_PASSES = 8
SEED = 0


def target_config(early_dir: str) -> Config:
    cfg = override(get_config(BASE), [f"data.paths={early_dir}", f"train.steps={TARGET_STEPS}"])
    return dataclasses.replace(cfg, name="dspark_target")


def post_config(late_dir: str, target_workdir: str) -> Config:
    cfg = override(
        get_config(BASE),
        [
            f"data.paths={late_dir}",
            f"train.steps={POST_STEPS}",
            f"train.init_from={target_workdir}",
            "optim.lr=1e-3",
            "optim.warmup_steps=20",
        ],
    )
    return dataclasses.replace(cfg, name="dspark_target_post")


QUICK = dict(
    BASE="tiny",
    TARGET_STEPS=6,
    POST_STEPS=4,
    DRAFTER_STEPS=4,
    ABLATION_STEPS=3,
    REALIGN_STEPS=2,
    NUM_PROMPTS=4,
    NEW_TOKENS=8,
    BATCHES=(1, 4),
    TIMING_REPEATS=1,
    TEMPERATURES=(0.0, 1.0),
    # 4 documents of 12 samples: the tiny config's validation split (1 of them) holds a batch
    SELF_TEXT=dict(
        num_samples=48,
        prompt_len=8,
        new_tokens=40,
        temperature=1.0,
        batch_size=48,
        samples_per_file=12,
    ),
    # 8 rows: the drafter batch is split over the 8 fake devices of the tests
    DRAFTER_COMMON=DRAFTER_COMMON + ["train.batch_size=8", "train.eval_batches=1"],
    SCHED_REPEATS=2,
    REPLAY_PASSES=2,
    ABLATIONS={"dspark_corpus": []},
)
