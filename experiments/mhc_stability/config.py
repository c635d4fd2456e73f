"""mHC stability: the same small model as a plain residual baseline, unconstrained HC (n = 4)
and mHC (n = 4), same data, steps and seeds. `get_config("mhc,seed=1")` picks an arm."""

from v41jax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from v41jax.mhc import MHCConfig

# The committed results were trained with the plain 20 Sinkhorn iterations, before the Newton
# polish became the default: the arms keep it, so a rerun reproduces them.
ARMS = {
    "baseline": MHCConfig(n_streams=0),
    "hc": MHCConfig(n_streams=4, residual="hc", sinkhorn_newton_steps=0),
    "mhc": MHCConfig(n_streams=4, residual="mhc", sinkhorn_newton_steps=0),
}
SEEDS = (0, 1)
STEPS = 300


def get_config(arg: str = "mhc,seed=0") -> Config:
    arm, _, seed = arg.partition(",seed=")
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; arms: {sorted(ARMS)}")
    return Config(
        name=f"mhc_stability_{arm}_seed{seed or 0}",
        data=DataConfig(vocab_size=4096, seq_len=128, global_batch_size=16),
        model=ModelConfig(
            vocab_size=4096,
            d_model=128,
            num_layers=8,
            num_heads=4,
            num_kv_heads=4,
            d_ff=384,
            max_seq_len=256,
            mhc=ARMS[arm],
        ),
        # A high peak LR on purpose: instability shows up where training is pushed.
        optim=OptimConfig(lr=6e-3, warmup_steps=30),
        train=TrainConfig(
            steps=STEPS,
            seed=int(seed or 0),
            log_every=5,
            eval_every=100,
            eval_batches=8,
            checkpoint_every=100,
        ),
        mesh=Config().mesh,
    )
