"""`8b`: a Llama-3-8B-like model (8.03B parameters) for 8 x 80 GiB GPUs (H100).

RMSNorm, SwiGLU (14,336 wide), RoPE (theta 500k), grouped-query attention (32 query / 8 KV
heads of 128), untied head, the Llama-3 vocabulary size (128,256). bf16 compute over fp32
master weights, FSDP over every device, full remat and the chunked loss; 8 x 4,096 tokens
per device (`python -m v41jax plan --config 8b --mesh data=1,fsdp=8,tensor=1 --platform
cuda`; README "Launching on TPU / GPU").

Variants (`VARIANTS`, named `8b-<variant>`): `8b-engram` (Engram memory at layers 1 and
15) and `8b-mhc` (mHC, 4 residual streams, V4.1's single-pass form).
"""

from v41jax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig

VOCAB = 128_256

# `--set` recipes: `get_config("8b-engram")` is `8b` with these overrides.
VARIANTS = {
    "engram": [
        "model.engram.layer_ids=1,15",
        # 2 orders x 8 heads x ~646k rows x 128 = 1.32B table params per layer
        "model.engram.engram_vocab_size=646400,646400",
        "model.engram.n_embed_per_ngram=1024",
        "model.engram.n_head_per_ngram=8",
        # the Engram layers' activations (measured: about twice the backbone's per row)
        # need smaller microbatches; the global batch stays 64
        "train.microbatches=4",
    ],
    # four [B, T, 4, D] residual streams, 4x the residual state: smaller microbatches
    "mhc": [
        "model.mhc.n_streams=4",
        "model.mhc.form=single_pass",
        "model.mhc.single_pass_impl=auto",  # the kernel on TPU / GPU, the XLA form on CPU
        "train.microbatches=8",
    ],
}


def get_config() -> Config:
    return Config(
        name="8b",
        data=DataConfig(vocab_size=VOCAB, seq_len=4096, global_batch_size=64),
        model=ModelConfig(
            vocab_size=VOCAB,
            d_model=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            d_ff=14_336,
            max_seq_len=4096,
            rope_theta=500_000.0,
            norm_eps=1e-5,
            tie_embeddings=False,
            compute_dtype="bfloat16",
            param_dtype="float32",
            logits_chunk=512,
            scan_layers=True,
            remat_policy="full",
        ),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1, z_loss=1e-4),
        train=TrainConfig(
            steps=100_000, log_every=50, eval_every=2000, eval_batches=16, checkpoint_every=1000
        ),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
    )
