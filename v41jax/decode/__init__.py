"""Decoding above the model: sampling settings and laws, KV-cache generation, and the exact
speculative-decoding engine (its round, its loops, the small-model drafter).

`sampling`: `SamplingParams` (temperature, top-k, top-p, min-p) and the one sampling law;
`generate`: prefill, one-token decode steps and `generate`; `engine` and `loops`: the speculative
round and the loops that run it for any drafter plug-in (`Proposer`); `speculative`: a small
transformer as that drafter (`speculative_generate`). The acceptance rule itself is
`v41jax.speculative` (pure math); the DSpark drafter plugs into the engine from `v41jax.dspark`.
"""

from v41jax.decode.generate import (
    DecodeState,
    decode_step,
    generate,
    init_cache,
    prefill,
    with_context_len,
)
from v41jax.decode.sampling import (
    GREEDY,
    SamplingParams,
    SamplingPlan,
    sample_logits,
    sample_probs,
    sampling_plan,
    sampling_probs,
)
from v41jax.decode.speculative import SpeculativeOutput, speculative_generate

__all__ = [
    "GREEDY",
    "DecodeState",
    "SamplingParams",
    "SamplingPlan",
    "SpeculativeOutput",
    "decode_step",
    "generate",
    "init_cache",
    "prefill",
    "sample_logits",
    "sample_probs",
    "sampling_plan",
    "sampling_probs",
    "speculative_generate",
    "with_context_len",
]
