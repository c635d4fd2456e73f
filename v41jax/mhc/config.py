"""`MHCConfig` lives in the config layer (`v41jax.config.mhc`), so configs load without this
package's jax code; re-exported here for the mHC modules and their callers."""

from v41jax.config.mhc import FORMS, RESIDUAL_KINDS, SINKHORN_VARIANTS, MHCConfig

__all__ = ["FORMS", "RESIDUAL_KINDS", "SINKHORN_VARIANTS", "MHCConfig"]
