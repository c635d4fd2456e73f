"""`MHCResidual`: the Linen shell that owns one sub-layer's mHC params (REFERENCE.md §2).

A thin shell over `v41jax.mhc.reference`: it creates the params with logical axis names and
calls `mhc_coefficients` + `mhc_apply`. One instance wraps one sub-layer (attention or FFN);
name it after that sub-layer. Only the "reference" form lives here; other forms (fused,
single-pass) reuse `mhc_coefficients` from their own files.

Params (float32; logical axes in parentheses):
  phi        [n*C, n^2+2n]  ("mhc_flat", "mhc_coeff")   N(0, 1/(nC))
  norm_scale [n*C]          ("mhc_flat",)               ones
  alpha      [3]            ("mhc_gates",)              cfg.alpha_init (pre, post, res)
  bias       [n^2+2n]       ("mhc_coeff",)              `reference.static_bias`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.mhc.config import MHCConfig
from v41jax.mhc.reference import (
    mhc_apply,
    mhc_coefficients,
    num_coeffs,
    phi_init_std,
    static_bias,
)


class MHCResidual(nn.Module):
    """`x <- H_res x + H_post^T F(H_pre x)` around one sub-layer F, on [B, T, n, C] streams.

    `__call__(x_BxTxNxC, sublayer_fn) -> (x_new_BxTxNxC, aux, h_res_BxTxNxN)`, where
    `sublayer_fn(h_BxTxC) -> (y_BxTxC, aux)`. H_res comes back for diagnostics (the caller
    sows or aggregates it, e.g. with `reference.composite_gain`).
    """

    cfg: MHCConfig
    width: int  # C

    @nn.compact
    def __call__(
        self,
        x_BxTxNxC: jax.Array,
        sublayer_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
    ) -> tuple[jax.Array, Any, jax.Array]:
        cfg, n, c = self.cfg, self.cfg.n_streams, self.width
        if n < 1:
            raise ValueError(f"MHCResidual: cfg.n_streams={n}; use the plain residual for 0")
        if cfg.form != "reference":
            raise ValueError(f"MHCResidual implements form='reference' only, got form={cfg.form!r}")
        if x_BxTxNxC.ndim < 2 or x_BxTxNxC.shape[-2:] != (n, c):
            raise ValueError(
                f"MHCResidual: expected x of shape [..., n={n}, C={c}], "
                f"got {tuple(x_BxTxNxC.shape)}"
            )
        k = num_coeffs(n)
        std = phi_init_std(n, c)
        params = {
            "phi": self.param(
                "phi",
                nn.with_logical_partitioning(
                    nn.initializers.normal(stddev=std), ("mhc_flat", "mhc_coeff")
                ),
                (n * c, k),
                jnp.float32,
            ),
            "norm_scale": self.param(
                "norm_scale",
                nn.with_logical_partitioning(nn.initializers.ones, ("mhc_flat",)),
                (n * c,),
                jnp.float32,
            ),
            "alpha": self.param(
                "alpha",
                nn.with_logical_partitioning(
                    nn.initializers.constant(cfg.alpha_init), ("mhc_gates",)
                ),
                (3,),
                jnp.float32,
            ),
            "bias": self.param(
                "bias",
                nn.with_logical_partitioning(
                    lambda _key, shape, dtype: static_bias(n, cfg.residual).astype(dtype),
                    ("mhc_coeff",),
                ),
                (k,),
                jnp.float32,
            ),
        }
        coeffs = mhc_coefficients(params, x_BxTxNxC, cfg)
        x_new, aux = mhc_apply(x_BxTxNxC, sublayer_fn, coeffs)
        return x_new, aux, coeffs[2]
