"""Single-Pass mHC step (lagged form): residual update, next input, next statistics.

``api.py`` holds the entry point, validation and gradient, ``dispatch.py`` the choice by
lowering platform, ``kernel.py`` the Pallas kernels (TPU: Mosaic; GPU: Triton), tiled over
tokens and C, ``plan.py`` their tiling, memory limits and block-spec traffic, and
``reference.py`` the step-by-step pure-jnp reference.
"""

from v41jax.kernels.mhc_single_pass.api import IMPLS, mhc_single_pass
from v41jax.kernels.mhc_single_pass.reference import single_pass_step_reference

__all__ = ["IMPLS", "mhc_single_pass", "single_pass_step_reference"]
