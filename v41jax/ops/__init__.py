"""Numerical primitives shared by several packages (the bottom layer: imports nothing else
from v41jax). Pure functions of arrays, so Linen shells, raw jit code and kernel references
all compute the same numbers."""

from v41jax.ops.norms import inv_rms, inv_rms_from_sumsq, rms_norm, rms_norm_f32
from v41jax.ops.sinkhorn_balance import sinkhorn_balance, sinkhorn_balanced_momentum

__all__ = [
    "inv_rms",
    "inv_rms_from_sumsq",
    "rms_norm",
    "rms_norm_f32",
    "sinkhorn_balance",
    "sinkhorn_balanced_momentum",
]
