"""Engram lookup: gather each token's H table rows (+FP8 dequantisation), concatenated.

``api.py`` holds the entry point and dispatch, ``kernel.py`` the Pallas kernels (TPU DMA
gather, GPU vector gather), ``reference.py`` the pure-jnp reference.
"""

from v41jax.kernels.engram_lookup.api import IMPLS, check_ids, engram_lookup
from v41jax.kernels.engram_lookup.reference import engram_lookup_reference

__all__ = ["IMPLS", "check_ids", "engram_lookup", "engram_lookup_reference"]
