"""Speculative verification: acceptances, first rejection, residual sample.

``api.py`` holds the entry point ``spec_verify`` and its dispatch (by lowering platform),
``limits.py`` the compiled kernels' block limits and costs, ``kernel.py`` the Pallas
kernels (one pass over the draft and target probability rows: a (batch, vocabulary-block)
grid on TPU, a per-row vocabulary loop on GPU), ``reference.py`` the plain-jnp definition on
supplied uniforms.
"""

from v41jax.kernels.spec_verify.api import IMPLS, spec_verify
from v41jax.kernels.spec_verify.reference import spec_verify_reference

__all__ = ["IMPLS", "spec_verify", "spec_verify_reference"]
