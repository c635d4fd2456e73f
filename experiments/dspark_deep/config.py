"""DSpark in its regime: a deep, weight-bound target against drafters of 1 to 3 blocks.

The target is 24 layers at d = 384 (the `small` family's tokenizer and corpus, BPE 4096);
a plain decode step of it costs ~16x a drafter block, which is the draft/target cost ratio
of the published setups (3-5 drafter layers against 36-61 target layers). It trains on the
speeches before SPLIT_YEAR of the bundled corpus, with short sequences (the decode cost does
not depend on the training sequence length, and short sequences buy steps on this CPU).
`QUICK` shrinks everything for the slow smoke test.
"""

import dataclasses

from v41jax.config import Config, get_config, override

BASE = "small"  # tokenizer, data and optimizer defaults; the model is deepened below
SPLIT_YEAR = 1946
TARGET_STEPS = 400
TARGET = [
    "model.d_model=384",
    "model.num_layers=24",
    "model.num_heads=6",
    "model.num_kv_heads=6",
    "model.d_ff=1024",
    "data.seq_len=128",
    "data.global_batch_size=16",
    "optim.lr=1.5e-3",
    "optim.warmup_steps=60",
    "train.log_every=10",
    "train.eval_every=200",
    "train.eval_batches=8",
    "train.checkpoint_every=25",
]
SEED = 0


def target_config(early_dir: str) -> Config:
    cfg = override(
        get_config(BASE), [f"data.paths={early_dir}", f"train.steps={TARGET_STEPS}", *TARGET]
    )
    return dataclasses.replace(cfg, name="dspark_deep_target")
