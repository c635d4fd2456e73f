"""v41jax: Engram, mHC and exact speculative decoding in JAX/Flax.

Subpackages import one way, each only from those before it (tests/test_architecture.py):
ops -> config, sharding -> data -> kernels -> engram -> mhc -> speculative -> model -> train ->
dspark -> sweep -> bench. `ops` holds the shared numerical primitives; `config` is plain
Python (no jax), so `import v41jax.config` stays cheap. This file imports nothing.
"""

__version__ = "0.1.0"
