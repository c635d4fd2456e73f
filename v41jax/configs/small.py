"""`small`: the quickstart model (240 steps of training).

4.5M parameters on the full default corpus (State of the Union addresses, BPE 4096).
"""

from v41jax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config() -> Config:
    return Config(
        name="small",
        data=DataConfig(vocab_size=4096, seq_len=256, global_batch_size=16),
        model=ModelConfig(
            vocab_size=4096,
            d_model=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            d_ff=768,
            max_seq_len=512,
        ),
        optim=OptimConfig(lr=3e-3, warmup_steps=50),
        train=TrainConfig(
            steps=240, log_every=10, eval_every=120, eval_batches=8, checkpoint_every=60
        ),
    )
