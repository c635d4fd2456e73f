"""mHC: manifold-constrained hyper-connections (config: v41jax.config.mhc)."""

from v41jax.config.mhc import FORMS, MHCConfig
from v41jax.mhc.layer import MHCResidual
from v41jax.mhc.reference import (
    composite_gain,
    expand_streams,
    mhc_apply,
    mhc_coefficients,
    mhc_params_init,
    reduce_streams,
    static_bias,
)
from v41jax.mhc.sinkhorn import sinkhorn_knopp, sinkhorn_knopp_unrolled

__all__ = [
    "FORMS",
    "MHCConfig",
    "MHCResidual",
    "composite_gain",
    "expand_streams",
    "mhc_apply",
    "mhc_coefficients",
    "mhc_params_init",
    "reduce_streams",
    "sinkhorn_knopp",
    "sinkhorn_knopp_unrolled",
    "static_bias",
]
