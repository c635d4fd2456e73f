"""Pallas kernels, one package per op: ``api.py`` (entry point + dispatch), ``kernel.py``
(Pallas), ``reference.py`` (pure jnp). Every kernel runs in interpret mode in the CPU tests.
"""

from v41jax.kernels.engram_lookup import check_ids, engram_lookup, engram_lookup_reference

__all__ = ["check_ids", "engram_lookup", "engram_lookup_reference"]
