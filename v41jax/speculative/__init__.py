"""Speculative decoding: the exact sampler, the throughput model and the verifier audit."""

from v41jax.speculative.sampler import IMPLS, check_speculative_inputs, speculative_sample
from v41jax.speculative.throughput import (
    expected_tokens_per_round,
    interpolate_cost,
    optimal_draft_length,
    walltime_speedup,
    walltime_speedup_measured,
)

__all__ = [
    "AuditReport",
    "IMPLS",
    "audit_verifier",
    "check_speculative_inputs",
    "expected_tokens_per_round",
    "interpolate_cost",
    "optimal_draft_length",
    "speculative_sample",
    "walltime_speedup",
    "walltime_speedup_measured",
]


def __getattr__(name: str):
    # Lazy: importing audit here eagerly would make `python -m v41jax.speculative.audit` warn that
    # the module was already imported by its package.
    if name in ("audit_verifier", "AuditReport"):
        from v41jax.speculative import audit

        return getattr(audit, name)
    raise AttributeError(f"module 'v41jax.speculative' has no attribute {name!r}")
