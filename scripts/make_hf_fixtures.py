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

Beside them, so each directory is a complete model that `import-hf` takes: tokenizer.json (a
300-word WordLevel vocabulary built with `tokenizers`) with its tokenizer_config.json, and
generate.json: for a few prompts, the input ids transformers' tokenizer gives (its template:
Llama and Mistral put a BOS `<s>` first by their tokenizer.json's TemplateProcessing, Qwen2 and
Qwen3 nothing) and transformers' greedy `generate` continuation of them. Llama's tokenizer
also says add_bos_token=true in its config, Qwen3's false (transformers 5 reads the template
from tokenizer.json alone when there is one). `--tokenizers-only` writes just these files
from the committed models (the tensors and golden logits are left as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

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
# 297 of 300 consonant-vowel(-consonant) words and 3 special tokens: the models' 300 ids.
WORDS = [c + v + e for e in ("", "n", "r", "s") for c in "bdfghklmnprstvz" for v in "aeiou"]
BOS_TEMPLATE = processors.TemplateProcessing(
    single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
)
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 (the configs' bos 1, eos 2)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 297, 298, 299
TOKENIZERS = {  # specials first?, post-processor, tokenizer_config.json
    "llama": (True, BOS_TEMPLATE, dict(add_bos_token=True, add_eos_token=False, bos_token="<s>",
                                       eos_token="</s>", unk_token="<unk>")),
    "mistral": (True, BOS_TEMPLATE, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")),
    "qwen2": (False, None, dict(bos_token=None, eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>")),
    "qwen3": (False, processors.ByteLevel(trim_offsets=False),
              dict(add_bos_token=False, bos_token=None, eos_token="<|im_end|>",
                   pad_token="<|endoftext|>")),
}  # fmt: skip
PROMPTS = ["ba", "ka mo ri", "zu ze zi zo za", "tan les mor dis"]
NEW_TOKENS = 12


def write_tokenizer(name: str, path: str) -> None:
    """tokenizer.json + tokenizer_config.json (see the module docstring)."""
    first, post, config = TOKENIZERS[name]
    specials = LLAMA_SPECIALS if first else QWEN_SPECIALS
    words = WORDS[: COMMON["vocab_size"] - len(specials)]
    vocab = specials + words if first else words + specials
    unk = "<unk>" if "<unk>" in vocab else None
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    if post is not None:
        tok.post_processor = post
    tok.save(os.path.join(path, "tokenizer.json"))
    config = dict(config, tokenizer_class="PreTrainedTokenizerFast", model_max_length=64)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_generation(name: str, path: str) -> None:
    """generate.json: transformers' template ids and greedy continuation of each prompt."""
    tok = PreTrainedTokenizerFast.from_pretrained(path)  # tokenizer.json as it is (AutoTokenizer
    # would take Qwen2Tokenizer for qwen2, which rebuilds a byte-level BPE from the vocabulary)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = PROMPTS + ([""] if tok("").input_ids else [])  # "" is just the template
    rows = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            eos = tok.eos_token_id
            out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=eos, pad_token_id=eos)  # fmt: skip
        new = out[0, ids.shape[1] :].tolist()
        if tok.eos_token_id in new:  # generate pads after the eos with it
            new = new[: new.index(tok.eos_token_id) + 1]
        rows.append({"text": text, "input_ids": ids[0].tolist(), "greedy": new})
    record = {"tokenizer": type(tok).__name__, "eos_id": tok.eos_token_id,
              "max_new_tokens": NEW_TOKENS, "prompts": rows}  # fmt: skip
    with open(os.path.join(path, "generate.json"), "w") as f:
        json.dump(record, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--tokenizers-only", action="store_true")
    args = parser.parse_args()
    if args.tokenizers_only:
        for name in FAMILIES:
            write_tokenizer(name, os.path.join(args.out, name))
            write_generation(name, os.path.join(args.out, name))
        return
    torch.manual_seed(0)
    seeded = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11), generator=seeded)
    for name, (config_cls, extra) in FAMILIES.items():
        cfg = config_cls(**COMMON, **extra)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("bias") or "norm" in pname:
                    p.copy_(p + 0.5 * torch.randn_like(p))
            logits = model(ids).logits.numpy()
        path = os.path.join(args.out, name)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path, max_shard_size=SHARDED.get(name, "50MB"))
        np.savez(os.path.join(path, "golden.npz"), input_ids=ids.numpy().astype(np.int32),
                 logits=logits.astype(np.float32))  # fmt: skip
        for extra_file in ("generation_config.json",):  # not read by the import
            if os.path.exists(os.path.join(path, extra_file)):
                os.remove(os.path.join(path, extra_file))
        write_tokenizer(name, path)
        write_generation(name, path)
        print(name, sorted(os.listdir(path)))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "numpy": np.__version__}  # fmt: skip
    with open(os.path.join(args.out, "versions.json"), "w") as f:
        json.dump(versions, f, indent=2)


if __name__ == "__main__":
    main()
