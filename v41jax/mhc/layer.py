"""`MHCResidual`: the Linen shell that owns one sub-layer's mHC params (mHC, arXiv 2512.24880).

A thin shell over the pure functions: it creates the params with logical axis names and
applies one of the three forms (`MHCConfig.form`). One instance wraps one sub-layer
(attention or FFN); name it after that sub-layer. The params are the same in every form.

  "reference"    `mhc_coefficients` + `mhc_apply` (`reference.py`), stage by stage.
  "fused"        the same coefficients, `pre_mix` for H_pre x and `fused_post_residual` for
                 `H_res x + H_post^T y` in one fusible expression (`fused.py`); equal to
                 "reference" up to float rounding.
  "single_pass"  the lagged formulation (`single_pass.py`): the state between sub-layers is
                 a `SinglePassState`, not the bare [B, T, n, C] streams. Sub-layer l's
                 module runs the one pass that ends sub-layer l-1 (`single_pass_step`: it
                 writes X_l, the ready input h_l = RMSNorm(A_{l-1} X_l; g_l) and the stats
                 vec(X_l) phi'_l, sum X_l^2), takes (A_l, C_l, B_l) from those stats, and runs
                 F_l(h_l). Its own residual update is left pending for the next module (or
                 `single_pass_readout`). The input-norm scale g_l is passed in by the caller:
                 the sub-layer must then NOT apply its own pre-norm (h_l is normalised).

Params (float32; logical axes in parentheses):
  phi        [n*C, n^2+2n]  ("mhc_flat", "mhc_coeff")   N(0, 1/(nC))
  norm_scale [n*C]          ("mhc_flat",)               ones
  alpha      [3]            ("mhc_gates",)              cfg.alpha_init (pre, post, res)
  bias       [n^2+2n]       ("mhc_coeff",)              `reference.static_bias`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from v41jax.kernels.mhc_single_pass.reference import rms_norm_f32
from v41jax.mhc.config import MHCConfig
from v41jax.mhc.fused import fused_post_residual, pre_mix
from v41jax.mhc.reference import (
    mhc_apply,
    mhc_coefficients,
    num_coeffs,
    phi_init_std,
    static_bias,
)
from v41jax.mhc.single_pass import (
    coefficients_from_stats,
    folded_phi,
    one_hot_pre,
    single_pass_step,
    stream_stats,
)


class SinglePassState(NamedTuple):
    """The residual state between sub-layers in form "single_pass".

    x: streams [B, T, n, C]; a_pre: the lagged pre-mapping [B, T, n] (fp32) that forms the
    next sub-layer input `RMSNorm(a_pre X)`; pending: None when X = x, else
    (y [B, T, C], H_res [B, T, n, n], H_post [B, T, n]): the update `X = H_res x + H_post^T y`
    of the previous sub-layer, not yet applied (the next pass applies it).
    """

    x: jax.Array
    a_pre: jax.Array
    pending: tuple[jax.Array, jax.Array, jax.Array] | None = None


def single_pass_init(x_BxTxNxC: jax.Array) -> SinglePassState:
    """The state of the expanded embedding X_0: layer 0 uses the one-hot pre-mapping."""
    return SinglePassState(x_BxTxNxC, one_hot_pre(tuple(x_BxTxNxC.shape[:-2]), x_BxTxNxC.shape[-2]))


def single_pass_materialize(state: SinglePassState) -> SinglePassState:
    """Apply a pending update: the same state with `pending=None` (for Engram, hidden outputs)."""
    if state.pending is None:
        return state
    y, h_res, h_post = state.pending
    return SinglePassState(fused_post_residual(state.x, y, h_post, h_res), state.a_pre)


def single_pass_readout(
    state: SinglePassState, norm_scale: jax.Array | None, eps: float, out_dtype
) -> tuple[jax.Array, jax.Array]:
    """The last pass: `(X_L [B, T, n, C], h_L = RMSNorm(A_{L-1} X_L; g) [B, T, C])`."""
    if state.pending is None:
        mixed = pre_mix(state.x.astype(jnp.float32), state.a_pre)
        return state.x, rms_norm_f32(mixed, norm_scale, eps).astype(out_dtype)
    y, h_res, h_post = state.pending
    x, h, _, _ = single_pass_step(
        state.x, y, h_res, h_post, state.a_pre, None, norm_scale, norm_eps=eps, out_dtype=out_dtype
    )
    return x, h


class NormScale(nn.Module):
    """Only the `scale` param of an `RMSNorm` (same name, init and logical axis): the input
    norm of a sub-layer whose normalisation the single-pass step applies."""

    width: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (self.width,),
            self.param_dtype,
        )


class MHCResidual(nn.Module):
    """`x <- H_res x + H_post^T F(H_pre x)` around one sub-layer F, on [B, T, n, C] streams.

    `__call__(x_BxTxNxC, sublayer_fn) -> (x_new_BxTxNxC, aux, h_res_BxTxNxN)`, where
    `sublayer_fn(h_BxTxC) -> (y_BxTxC, aux)`. H_res comes back for diagnostics (the caller
    sows or aggregates it, e.g. with `reference.composite_gain`). Form "single_pass":
    `__call__(state, sublayer_fn, norm_scale) -> (new_state, aux, h_res)` on
    `SinglePassState`s; norm_scale [C] is g_l, the sub-layer's input-norm scale (or None).
    """

    cfg: MHCConfig
    width: int  # C
    norm_eps: float = 1e-6  # the input norm's eps (form "single_pass")

    @nn.compact
    def __call__(
        self,
        x_BxTxNxC: jax.Array | SinglePassState,
        sublayer_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
        norm_scale: jax.Array | None = None,
    ) -> tuple[Any, Any, jax.Array]:
        cfg, n, c = self.cfg, self.cfg.n_streams, self.width
        if n < 1:
            raise ValueError(f"MHCResidual: cfg.n_streams={n}; use the plain residual for 0")
        if (cfg.form == "single_pass") != isinstance(x_BxTxNxC, SinglePassState):
            raise ValueError(
                f"MHCResidual: form={cfg.form!r} takes "
                f"{'a SinglePassState' if cfg.form == 'single_pass' else 'a [B, T, n, C] array'}"
            )
        state = x_BxTxNxC if cfg.form == "single_pass" else None
        if state is not None:
            x_BxTxNxC = state.x
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
        if state is not None:
            return self._single_pass(params, state, sublayer_fn, norm_scale)
        coeffs = mhc_coefficients(params, x_BxTxNxC, cfg)
        if cfg.form == "reference":
            x_new, aux = mhc_apply(x_BxTxNxC, sublayer_fn, coeffs)
            return x_new, aux, coeffs[2]
        h_pre, h_post, h_res = coeffs  # "fused"
        y_BxTxC, aux = sublayer_fn(pre_mix(x_BxTxNxC, h_pre))
        return fused_post_residual(x_BxTxNxC, y_BxTxC, h_post, h_res), aux, h_res

    def _single_pass(self, params, state: SinglePassState, sublayer_fn, norm_scale):
        """Finish the previous sub-layer's update while forming h_l and X_l's stats, then F_l."""
        phi = folded_phi(params)
        dtype = state.x.dtype
        if state.pending is None:  # X_l is materialised (layer 0, or after Engram)
            x = state.x
            proj, sumsq = stream_stats(x, phi)
            mixed = pre_mix(x.astype(jnp.float32), state.a_pre)
            h = rms_norm_f32(mixed, norm_scale, self.norm_eps).astype(dtype)
        else:
            y_prev, res_prev, post_prev = state.pending
            x, h, proj, sumsq = single_pass_step(
                state.x,
                y_prev,
                res_prev,
                post_prev,
                state.a_pre,
                phi,
                norm_scale,
                norm_eps=self.norm_eps,
                out_dtype=dtype,
                impl=self.cfg.single_pass_impl,
            )
        h_pre, h_post, h_res = coefficients_from_stats(params, proj, sumsq, self.cfg)
        y, aux = sublayer_fn(h)
        if y.shape != h.shape:
            raise ValueError(f"MHCResidual: sublayer output {y.shape} != its input {h.shape}")
        return SinglePassState(x, h_pre, (y, h_res, h_post)), aux, h_res
