"""Write the golden Hugging Face fixtures of tests/fixtures/hf/ (run once; the files are
committed, so the tests need neither torch nor transformers).

    python -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers
    /tmp/hfenv/bin/python scripts/make_hf_fixtures.py

For each family a randomly initialised tiny model (Llama, Mistral, Qwen2, Qwen3; GQA, tied
and untied embeddings, several RoPE thetas, a head_dim that is not d_model / heads, Qwen2's
q/k/v biases and Qwen3's q/k norms) is saved by `save_pretrained` (config.json and
safetensors; Llama in two shards with an index, as large checkpoints come), with
`golden.npz`: input ids [2, 11] and the model's fp32 logits [2, 11, V]. Biases and norm
weights are drawn at random (transformers initialises them to zeros and ones, which would
hide a wrong mapping). versions.json records the versions that made them.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
              rms_norm_eps=1e-6, max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),  # fmt: skip
    "mistral": (
        transformers.MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
             sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),  # fmt: skip
    "qwen2": (
        transformers.Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),  # fmt: skip
    "qwen3": (
        transformers.Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),  # fmt: skip
}
SHARDED = {"llama": "20KB"}


def main() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    for name, (config_cls, extra) in FAMILIES.items():
        cfg = config_cls(**COMMON, **extra)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("bias") or "norm" in pname:
                    p.copy_(p + 0.5 * torch.randn_like(p))
            logits = model(ids).logits.numpy()
        path = os.path.join(OUT, name)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path, max_shard_size=SHARDED.get(name, "50MB"))
        np.savez(os.path.join(path, "golden.npz"), input_ids=ids.numpy().astype(np.int32),
                 logits=logits.astype(np.float32))  # fmt: skip
        for extra_file in ("generation_config.json",):  # not read by the import
            if os.path.exists(os.path.join(path, extra_file)):
                os.remove(os.path.join(path, extra_file))
        print(name, sorted(os.listdir(path)))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "numpy": np.__version__}  # fmt: skip
    with open(os.path.join(OUT, "versions.json"), "w") as f:
        json.dump(versions, f, indent=2)


if __name__ == "__main__":
    main()
