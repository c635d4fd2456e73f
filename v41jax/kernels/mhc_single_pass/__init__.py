"""Single-Pass mHC step (REFERENCE.md §2): residual update, next input, next statistics.

``api.py`` holds the entry point and dispatch, ``kernel.py`` the Pallas kernel (a grid over
token blocks), ``reference.py`` the step-by-step pure-jnp reference.
"""

from v41jax.kernels.mhc_single_pass.api import IMPLS, mhc_single_pass
from v41jax.kernels.mhc_single_pass.reference import single_pass_step_reference

__all__ = ["IMPLS", "mhc_single_pass", "single_pass_step_reference"]
