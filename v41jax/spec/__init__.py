"""Speculative decoding: the throughput model (sampler and verifier audit follow)."""

from v41jax.spec.throughput import (
    expected_tokens_per_round,
    interpolate_cost,
    optimal_draft_length,
    walltime_speedup,
    walltime_speedup_measured,
)

__all__ = [
    "expected_tokens_per_round",
    "interpolate_cost",
    "optimal_draft_length",
    "walltime_speedup",
    "walltime_speedup_measured",
]
