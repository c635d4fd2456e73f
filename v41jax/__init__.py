"""v41jax: Engram, mHC and exact speculative decoding in JAX/Flax."""

__version__ = "0.1.0"
