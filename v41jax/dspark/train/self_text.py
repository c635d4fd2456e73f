"""The target's own text: samples of a trained run written as text files, for drafter training.

A drafter is judged by how often the target accepts its drafts, i.e. by how well it predicts
what the *target* would emit next, several tokens ahead. Trained on corpus text, the drafter's
positions k >= 2 learn the target's distribution after the corpus's intermediate tokens, not
after the target's own; trained on the target's samples (self-distillation, as Medusa-2 and
EAGLE do) the intermediate tokens follow the target's law, as they do when drafting.

    write_target_samples(run, out_dir, num_samples=2048, prompt_len=16, new_tokens=240)

Each sample continues a `prompt_len`-token window of the run's training text (windows spread
evenly over it) by `new_tokens` tokens at `temperature`; the prompt and the continuation are
decoded together (cut at EOS) and written as `out_dir/sample_NNNNN.txt`, `samples_per_file` per
file (default 1: one document per sample, so packed training sequences never attend across
samples). Train a drafter on them with `--set train.data_paths=out_dir`. Finished when
`out_dir/done.json` exists (then nothing is regenerated).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from tqdm import tqdm

from v41jax.data import load_data
from v41jax.decode import SamplingParams, generate


def write_target_samples(
    run,
    out_dir: str,
    *,
    num_samples: int = 2048,
    prompt_len: int = 16,
    new_tokens: int = 240,
    temperature: float = 1.0,
    batch_size: int = 64,
    samples_per_file: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Write `num_samples` samples of the trained `run` (a `load_run` result) into `out_dir`;
    returns the record saved as done.json (settings, tokens written)."""
    for name, v in (
        ("num_samples", num_samples),
        ("prompt_len", prompt_len),
        ("new_tokens", new_tokens),
        ("batch_size", batch_size),
        ("samples_per_file", samples_per_file),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (samples, not greedy text)")
    cfg = run.cfg.model
    if prompt_len + new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt_len {prompt_len} + new_tokens {new_tokens} exceeds the target's "
            f"max_seq_len {cfg.max_seq_len}"
        )
    done_path = os.path.join(out_dir, "done.json")
    settings = dict(
        num_samples=num_samples,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        temperature=temperature,
        samples_per_file=samples_per_file,
        seed=seed,
        step=int(run.step),
    )
    if os.path.exists(done_path):
        with open(done_path) as f:
            record = json.load(f)
        if record["settings"] != settings:
            raise ValueError(
                f"{out_dir} holds samples made with {record['settings']}, not {settings}: "
                "use another directory"
            )
        return record
    os.makedirs(out_dir, exist_ok=True)
    # the target's training tokens (a memory map when it trained from a token dir)
    tokens = load_data(run.cfg.data, tokenizer=run.tokenizer).train_tokens
    starts = np.linspace(0, tokens.size - prompt_len - 1, num_samples).astype(np.int64)
    eos, written = run.tokenizer.eos_id, 0
    sampling = SamplingParams(temperature=temperature)
    key = jax.random.key(seed)
    bar = tqdm(total=num_samples, disable=not progress, desc="target samples")
    for lo in range(0, num_samples, batch_size):
        s = starts[lo : lo + batch_size]
        prompts = np.stack([tokens[i : i + prompt_len] for i in s]).astype(np.int32)
        key, sub = jax.random.split(key)
        out = generate(
            run.params,
            cfg,
            prompts,
            np.full((len(s),), prompt_len, np.int32),
            max_new_tokens=new_tokens,
            sampling=sampling,
            rng=sub,
            eos_id=eos,
            compression=run.compression.table,
        )
        for j, (prompt, cont) in enumerate(zip(prompts, np.asarray(out), strict=True)):
            ids = [int(t) for t in cont]
            ids = ids[: ids.index(eos)] if eos in ids else ids
            text = run.tokenizer.decode([int(t) for t in prompt] + ids)
            i = lo + j
            name = f"sample_{i - i % samples_per_file:05d}.txt"
            with open(os.path.join(out_dir, name), "w" if i % samples_per_file == 0 else "a") as f:
                f.write(text + "\n\n")
            written += len(ids)
        bar.update(len(s))
    bar.close()
    record = {"settings": settings, "new_tokens_written": written}
    with open(done_path, "w") as f:
        json.dump(record, f, indent=1)
    return record
