"""`EngramConfig` lives in the config layer (`v41jax.config.engram`), so configs load without
this package's jax code; re-exported here for the Engram modules and their callers."""

from v41jax.config.engram import TABLE_DTYPES, EngramConfig, require_vocab, validate_engram

__all__ = ["TABLE_DTYPES", "EngramConfig", "require_vocab", "validate_engram"]
