"""`tiny`: a few-hundred-kB model on a slice of the default corpus; a step is milliseconds.

Used by the tests and for smoke-running any command here.
"""

from v41jax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="tiny",
        data=DataConfig(vocab_size=512, seq_len=64, global_batch_size=8, max_documents=24),
        model=ModelConfig(
            vocab_size=512,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            d_ff=192,
            max_seq_len=128,
        ),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
        train=TrainConfig(
            steps=200, log_every=10, eval_every=100, eval_batches=2, checkpoint_every=100
        ),
    )
