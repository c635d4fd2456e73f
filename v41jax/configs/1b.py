"""`1b`: a Llama-3.2-1B-like model (1.24B parameters) for a TPU v5e-8 (8 x 16 GiB).

RMSNorm, SwiGLU, RoPE (theta 500k), grouped-query attention (32 query / 8 KV heads of 64),
tied embeddings, the Llama-3 vocabulary size (128,256; the tokenizer is trained to it on
`data.paths`). bf16 compute over fp32 master weights, FSDP over every device, full remat
and the chunked loss so 8 x 2,048 tokens per device fit 16 GiB (`python -m v41jax plan
--config 1b --mesh data=1,fsdp=8,tensor=1 --platform tpu`; README "Launching on TPU / GPU").

Variants (`VARIANTS`, named `1b-<variant>`): `1b-engram` (Engram memory at layers 1 and 8)
and `1b-mhc` (mHC, 4 residual streams, V4.1's single-pass form).
"""

from v41jax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig

VOCAB = 128_256

# `--set` recipes: `get_config("1b-engram")` is `1b` with these overrides.
VARIANTS = {
    "engram": [
        "model.engram.layer_ids=1,8",
        # 2 orders x 8 heads x ~262k rows x 64 = 268M table params per layer
        "model.engram.engram_vocab_size=262144,262144",
        "model.engram.n_embed_per_ngram=512",
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
        "train.microbatches=4",
    ],
}


def get_config() -> Config:
    return Config(
        name="1b",
        data=DataConfig(vocab_size=VOCAB, seq_len=2048, global_batch_size=64),
        model=ModelConfig(
            vocab_size=VOCAB,
            d_model=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            d_ff=8192,
            max_seq_len=2048,
            rope_theta=500_000.0,
            norm_eps=1e-5,
            tie_embeddings=True,
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
