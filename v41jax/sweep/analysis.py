"""Study 3, what the memory holds: per-token validation losses, Engram on and off, by token type.

Engram off. A block with Engram computes `h <- h + v`, `v = alpha * (e W_V + b_V)` (plus
`SiLU(conv(RMSNorm(v)))` with the optional conv, which is 0 at v = 0). Zeroing W_V and b_V
therefore makes v = 0 exactly whatever the gate alpha: the block is the block without Engram.
`engram_off_params` is that surgery; `analyze_run` checks it on the first validation batch
against the same params with the Engram subtrees removed and an Engram-free config
(`strip_engram`), and records the largest |logit difference| (0 up to float rounding).

Per-token loss of the target y_t = x_{t+1} at position t: `ce_t = logsumexp(z_t) - z_t[y_t]`
(fp32, loss-masked), on the run's own validation batches (so the "all" loss with Engram on
is the run's val_loss). Token types, each a partition of the scored tokens:

- context_bigram: the count, in the training stream, of the bigram (x_{t-1}, x_t) of
  compressed ids: the key the memory's order-2 heads hash to predict y_t. rare: count <
  RARE_BELOW (unseen included), medium: up to FREQUENT_FROM - 1, frequent: >= FREQUENT_FROM.
  x_{t-1} is Engram's pad id at a document start (and at a window start in batches, as the
  memory sees it). On the default corpus (BPE 4096, V' = 3580, 32 validation batches of
  16 x 128) the tokens split 21% / 38% / 41%.
- word: `continuation` when y_t's text starts with a letter or digit and x_t's text ends
  with one (mid-word, no space between), else `word_start` (a new word, punctuation,
  whitespace, end of text): 83% / 17% of the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig
from v41jax.data import CompressionTable, Tokenizer, compress_ids, load_data
from v41jax.model import ENGRAM_IDS_PREFIX, Transformer, convert_layout, layer_segments
from v41jax.train.loop import load_run, validation_batches

ANALYSES = ("engram_off", "token_split")
RARE_BELOW, FREQUENT_FROM = 10, 100
BIGRAM_BUCKETS = ("rare", "medium", "frequent")
WORD_BUCKETS = ("word_start", "continuation")
_VALUE_PATH = ("w_v", "b_v")


def analysis_path(workdir: str, name: str) -> str:
    return os.path.join(workdir, f"analysis_{name}.json")


# ----------------------------------------------------------------------------- surgery


def engram_off_params(params: Any) -> dict:
    """`params` (boxed or not) with every Engram module's W_V and b_V zeroed: v = 0."""
    flat = traverse_util.flatten_dict(nn.unbox(params))
    if not any("engram" in path for path in flat):
        raise ValueError("engram_off_params: the params have no Engram module")
    return traverse_util.unflatten_dict(
        {
            path: jnp.zeros_like(x) if "engram" in path and path[-1] in _VALUE_PATH else x
            for path, x in flat.items()
        }
    )


def strip_engram(params: Any, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """The params without their Engram subtrees and `cfg` without Engram layers, in that
    config's layer layout (an Engram layer is a block of its own under `model.scan_layers`;
    without Engram it joins its neighbours' scanned run)."""
    flat = traverse_util.flatten_dict(nn.unbox(params))
    kept = {path: x for path, x in flat.items() if "engram" not in path}
    no_engram = dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, layer_ids=()))
    stripped = convert_layout(traverse_util.unflatten_dict(kept), layer_segments(no_engram))
    return stripped, no_engram


@functools.partial(jax.jit, static_argnames=("cfg",))
def model_logits(cfg: ModelConfig, params: Any, batch: dict) -> jax.Array:
    """float32 logits [B, T, V] of `Transformer(cfg)` on a batch (with its Engram ids)."""
    extras = {k: v for k, v in batch.items() if k.startswith(ENGRAM_IDS_PREFIX)}
    out, _ = Transformer(cfg).apply(
        {"params": params},
        batch["inputs"],
        batch["positions"],
        batch["segment_ids"],
        extras=extras,
        mutable=["intermediates"],  # MoE layers sow routing stats; not needed here
    )
    return out.logits


@functools.partial(jax.jit, static_argnames=("cfg",))
def token_losses(cfg: ModelConfig, params: Any, batch: dict) -> jax.Array:
    """Per-token cross-entropy [B, T] (fp32): `logsumexp(z_t) - z_t[y_t]`, unmasked."""
    logits = model_logits(cfg, params, batch)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


def _model_batch(batch: dict) -> dict:
    keep = ("inputs", "targets", "positions", "segment_ids")
    return {k: v for k, v in batch.items() if k in keep or k.startswith(ENGRAM_IDS_PREFIX)}


# ----------------------------------------------------------------------------- token types


def previous_ids(ids: np.ndarray, segment_ids: np.ndarray, pad_id: int) -> np.ndarray:
    """x_{t-1} along the last axis, `pad_id` at t = 0 and where a new segment starts."""
    prev = np.concatenate([np.full_like(ids[..., :1], pad_id), ids[..., :-1]], axis=-1)
    starts = np.concatenate(
        [np.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]],
        axis=-1,
    )
    return np.where(starts, pad_id, prev)


@dataclasses.dataclass(frozen=True)
class BigramCounts:
    """Counts of compressed-id bigrams `prev * V' + cur` (sorted keys) in a token stream."""

    keys: np.ndarray
    counts: np.ndarray
    vocab: int

    @classmethod
    def from_stream(cls, ids: np.ndarray, segments: np.ndarray, pad_id: int, vocab: int):
        ids = ids.astype(np.int64)
        keys, counts = np.unique(
            previous_ids(ids, segments, pad_id) * vocab + ids, return_counts=True
        )
        return cls(keys, counts, vocab)

    def lookup(self, prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
        """Count of each bigram (prev, cur) (0 if never seen), same shape as `cur`."""
        keys = prev.astype(np.int64) * self.vocab + cur.astype(np.int64)
        idx = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[idx] == keys, self.counts[idx], 0)


def word_tables(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: its text starts with a letter/digit; its text ends with one. bool [V]."""
    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    starts = np.array([p[:1].isalnum() for p in pieces], bool)
    ends = np.array([p[-1:].isalnum() for p in pieces], bool)
    return starts, ends


def token_type_masks(
    batch: dict,
    compression: CompressionTable,
    counts: BigramCounts,
    words: tuple[np.ndarray, np.ndarray],
    pad_id: int,
) -> dict[str, dict[str, np.ndarray]]:
    """{group: {bucket: bool [B, T]}}; each group partitions the loss-masked tokens."""
    scored = batch["loss_mask"].astype(bool)
    cur = compress_ids(batch["inputs"], compression)
    n = counts.lookup(previous_ids(cur, batch["segment_ids"], pad_id), cur)
    starts, ends = words
    continuation = starts[batch["targets"]] & ends[batch["inputs"]]
    return {
        "all": {"all": scored},
        "context_bigram": {
            "rare": scored & (n < RARE_BELOW),
            "medium": scored & (n >= RARE_BELOW) & (n < FREQUENT_FROM),
            "frequent": scored & (n >= FREQUENT_FROM),
        },
        "word": {"word_start": scored & ~continuation, "continuation": scored & continuation},
    }


# ----------------------------------------------------------------------------- the analysis


def analyze_run(workdir: str, engram_off: bool, num_batches: int | None = None) -> dict:
    """Per-token validation losses of the run in `workdir` by token type (module docstring);
    with `engram_off` also with Engram switched off, and the surgery check."""
    run = load_run(workdir)
    cfg, model_cfg = run.cfg, run.cfg.model
    if engram_off and not model_cfg.engram.enabled:
        raise ValueError(f"engram_off analysis of {workdir}: the model has no Engram layers")
    data = load_data(cfg.data, tokenizer=run.tokenizer)  # the run's token dir when it has one
    batches = validation_batches(cfg, data, num_batches or cfg.train.eval_batches)
    pad_id = model_cfg.engram.pad_id
    v_prime = data.compression.compressed_vocab_size
    counts = BigramCounts.from_stream(
        compress_ids(data.train_tokens, data.compression), data.train_segments, pad_id, v_prime
    )
    words = word_tables(run.tokenizer)
    params = jax.device_get(nn.unbox(run.params))  # host copy: analysis runs off the mesh
    variants = {"loss": params}
    out: dict[str, Any] = {"workdir": workdir, "step": run.step, "engram_off": engram_off}
    if engram_off:
        variants["loss_engram_off"] = engram_off_params(params)
        stripped, plain_cfg = strip_engram(params, model_cfg)
        b0 = _model_batch(batches[0])
        diff = model_logits(model_cfg, variants["loss_engram_off"], b0) - model_logits(
            plain_cfg, stripped, b0
        )
        out["check_max_abs_logit_diff"] = float(jnp.abs(diff).max())
    sums: dict = {}  # {group: {bucket: {"tokens": n, variant: sum of ce}}}
    for batch in batches:
        masks = token_type_masks(batch, data.compression, counts, words, pad_id)
        model_batch = _model_batch(batch)
        losses = {
            k: np.asarray(token_losses(model_cfg, p, model_batch)) for k, p in variants.items()
        }
        for group, buckets in masks.items():
            for bucket, mask in buckets.items():
                acc = sums.setdefault(group, {}).setdefault(bucket, {"tokens": 0.0})
                acc["tokens"] += float(mask.sum())
                for k, ce in losses.items():
                    acc[k] = acc.get(k, 0.0) + float(ce[mask].sum(dtype=np.float64))
    groups = {
        g: {b: _stats(acc, sums, variants) for b, acc in bs.items()} for g, bs in sums.items()
    }
    out["groups"] = groups
    out["thresholds"] = {"rare_below": RARE_BELOW, "frequent_from": FREQUENT_FROM}
    return out


def _stats(acc: dict, sums: dict, variants: dict) -> dict:
    """Mean loss per variant over a bucket; `delta` = loss with Engram off - loss with it on."""
    n = acc["tokens"]
    stats = {"tokens": int(n), "share": n / sums["all"]["all"]["tokens"]}
    stats |= {k: acc[k] / n if n else float("nan") for k in variants}
    if "loss_engram_off" in stats:
        stats["delta"] = stats["loss_engram_off"] - stats["loss"]
    return stats


def run_analysis(name: str, workdir: str) -> dict:
    """Run analysis `name` (one of ANALYSES) on a finished run; write analysis_<name>.json."""
    if name not in ANALYSES:
        raise ValueError(f"unknown analysis {name!r}; known: {list(ANALYSES)}")
    result = analyze_run(workdir, engram_off=name == "engram_off")
    result["analysis"] = name
    tmp = analysis_path(workdir, name) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, analysis_path(workdir, name))
    return result


def load_or_run_analysis(name: str, workdir: str) -> dict:
    """The cached analysis_<name>.json of `workdir`, computing it first if missing."""
    path = analysis_path(workdir, name)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return run_analysis(name, workdir)
