"""Speculative decoding with a separate small model as the drafter (`ModelProposer`).

The round, history, rollback and loops are the engine's (`v41jax.decode.engine`);
this module is the drafter plug-in. Per round, with the pending token at slot pos:

  drafter: feed (history[pos-1], pending) at pos-1 (re-writing slot pos-1 with the same
  entry, and filling it when the last round accepted all K drafts), then d_1..d_{K-1} one at
  a time; q_j = sampling_probs(drafter logits), d_j ~ q_j                       (K calls)
and the engine's target verifies (pending, d_1, .., d_K) in one call of K + 1 tokens. Both
models get the same sampling settings, which is what makes the output exact.

Shapes: B rows, P prompt width, S = min(max_seq_len of both models).
Requirement: max(prompt length) + max_new_tokens + 2K <= S (a row that finished keeps
running with its position frozen until every row is done).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config import ModelConfig
from v41jax.decode.engine import (
    Ctx,
    Proposal,
    Static,
    check_prompt_batch,
    extend_output,
    write_history,
)
from v41jax.decode.generate import check_compression
from v41jax.decode.generate import prefill as model_prefill
from v41jax.decode.loops import run_rounds
from v41jax.decode.sampling import GREEDY, SamplingParams, sample_probs


class SpeculativeOutput(NamedTuple):
    """tokens int32 [B, max_new_tokens]; rounds int32 [B] (rounds while the row was
    unfinished); accepted_counts int32 [B, K+1]: rounds that accepted exactly a drafts."""

    tokens: jax.Array
    rounds: jax.Array
    accepted_counts: jax.Array


@dataclass(frozen=True)
class ModelProposer:
    """A small transformer drafting K tokens one at a time through its own KV cache (params:
    its params; state: its caches). No confidence head: its confidences are zeros."""

    cfg: ModelConfig
    block_size: int
    hidden_layers: tuple[int, ...] = ()

    @property
    def slack(self) -> int:
        return 2 * self.block_size

    def seq_len(self, target_cfg: ModelConfig) -> int:
        return min(target_cfg.max_seq_len, self.cfg.max_seq_len)

    def init(self, params, target_out, prompts_BxP, lengths_B, compression):
        return model_prefill(params, self.cfg, prompts_BxP, lengths_B, compression)[1].kv

    def _extend(self, params, kv, history_BxS, start_B, t: int, compression):
        out = extend_output(params, self.cfg, kv, history_BxS, start_B, t, compression)
        return out.logits.astype(jnp.float32), out.cache

    def propose(self, params, kv, history_BxS, pos_B, active_B, key, probs, compression):
        k = self.block_size
        keys = jax.random.split(key, k)
        # the first call also (re)writes slot pos - 1
        logits, kv = self._extend(params, kv, history_BxS, pos_B - 1, 2, compression)
        q_list, hist = [], history_BxS
        for j in range(k):
            if j > 0:
                logits, kv = self._extend(params, kv, hist, pos_B + j, 1, compression)
            q_j = probs(logits[:, -1])
            q_list.append(q_j)
            draft_B = sample_probs(keys[j], q_j)
            hist = write_history(hist, pos_B + j + 1, draft_B[:, None], active_B[:, None])
        drafts = jnp.take_along_axis(hist, pos_B[:, None] + 1 + jnp.arange(k), axis=1)
        conf = jnp.zeros(drafts.shape, jnp.float32)
        return Proposal(drafts, jnp.stack(q_list, axis=1), conf), kv

    def observe(self, params, kv, history_BxS, target_out, start_B, compression):
        # The next proposal re-feeds slots pos - 1 and pos, which covers every verified
        # round. After a plain round (one slot verified, no drafts) slot `start` must be
        # fed here, or a run of plain rounds would leave holes in the drafter's cache.
        if target_out.logits.shape[1] != 1:
            return kv
        return self._extend(params, kv, history_BxS, start_B, 1, compression)[1]


def check_speculative_generate_args(target_cfg, draft_cfg, prompt_shape, lengths, n_new, k):
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ValueError(
            f"target vocab_size={target_cfg.vocab_size} != drafter vocab_size="
            f"{draft_cfg.vocab_size}: both must sample over the same vocabulary"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft={k!r} must be an int >= 1")
    check_prompt_batch(prompt_shape, lengths, n_new)
    s = min(target_cfg.max_seq_len, draft_cfg.max_seq_len)
    need = int(lengths.max()) + n_new + 2 * k
    if max(need, prompt_shape[1]) > s:
        raise ValueError(
            f"prompt length {int(lengths.max())} + max_new_tokens {n_new} + 2 * num_draft {k} "
            f"= {need} exceeds the smaller max_seq_len {s} (P = {prompt_shape[1]})"
        )


def speculative_generate(
    target_params: Any,
    target_cfg: ModelConfig,
    draft_params: Any,
    draft_cfg: ModelConfig,
    prompt_tokens_BxP: Any,
    prompt_lengths_B: Any,
    *,
    max_new_tokens: int,
    num_draft: int,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    compression: Any = None,
) -> SpeculativeOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens, speculatively.

    The output is distributed exactly as `generate(target_params, target_cfg, ...)` with
    the same `sampling` (token-for-token equal when greedy). `compression` is
    required when either model has Engram layers.
    """
    check_speculative_generate_args(
        target_cfg,
        draft_cfg,
        tuple(np.shape(prompt_tokens_BxP)),
        prompt_lengths_B,
        max_new_tokens,
        num_draft,
    )
    check_compression(target_cfg, compression)
    check_compression(draft_cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
    c = Ctx(
        target_params, draft_params, sampling.as_arrays(), compression, lengths + max_new_tokens
    )
    st = Static(target_cfg, ModelProposer(draft_cfg, num_draft), max_new_tokens, num_draft)
    rng = jax.random.key(0) if rng is None else rng
    out = run_rounds(c, jnp.asarray(prompt_tokens_BxP, jnp.int32), lengths, rng, st, "device")
    counts = out.active[..., None] & (out.accepted[..., None] == jnp.arange(num_draft + 1))
    return SpeculativeOutput(out.tokens, out.rounds, counts.sum(0).astype(jnp.int32))
