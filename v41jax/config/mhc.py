"""`MHCConfig`: manifold-constrained hyper-connections around every sub-layer.

`n_streams = 0` is the plain residual model (no mHC parameters). With n >= 1 the residual
state is n streams [B, T, n, C], mixed around every attention and FFN sub-layer by
`x <- H_res x + H_post^T F(H_pre x)`; n = 1 is the gated residual `x + H_post F(H_pre x)`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

# The residual forms the backbone can train with (same params in every form).
Form = Literal["reference", "fused", "single_pass"]
ResidualKind = Literal["mhc", "hc"]
SinkhornVariant = Literal["paper", "v4"]
SinglePassImpl = Literal["xla", "pallas", "auto"]
FORMS = typing.get_args(Form)
RESIDUAL_KINDS = typing.get_args(ResidualKind)
SINKHORN_VARIANTS = typing.get_args(SinkhornVariant)
SINGLE_PASS_IMPLS = typing.get_args(SinglePassImpl)


# Fields added after runs were saved, with the value a saved mHC config (n_streams >= 1)
# lacking them means (the behaviour before the field existed); `v41jax.config.text.from_dict`
# fills them in. Without mHC they define nothing, and a saved config takes today's default.
LEGACY_DEFAULTS = {"sinkhorn_newton_steps": 0}


@dataclass(frozen=True)
class MHCConfig:
    """n_streams: residual streams n (0 = plain residual, off; 1 = gated residual).
    form: how the update is computed (see FORMS and `v41jax.mhc.layer.MHCResidual`; the params
        are identical in every form):
        "reference": the paper's equations step by step.
        "fused": the same maths, the post + residual apply as one fused pass
            (`v41jax.mhc.fused.fused_post_residual`); equal to "reference" up to float rounding.
        "single_pass": the lagged Single-Pass formulation (`v41jax.mhc.single_pass`):
            sub-layer l's input is RMSNorm(A_{l-1} X_l) with the PREVIOUS sub-layer's
            pre-mapping (layer 0: one-hot on stream 0), and one pass per sub-layer writes
            X_{l+1}, the next input and the next coefficients' statistics. A different
            model from the other two (not numerically equal). In the backbone the sub-layers'
            own pre-norms (`attn_norm`, `ffn_norm`) are folded into that pass (their `scale`
            params remain, the sub-layer does not re-normalise), and the readout before the
            head is RMSNorm(A_{L-1} X_L; final_norm.scale) instead of RMSNorm(sum of streams).
    residual: "mhc" (H_res Sinkhorn-projected, doubly stochastic) or "hc" (unconstrained
        hyper-connections, H_res = identity-initialised free matrix: the unstable baseline).
    sinkhorn_iters, sinkhorn_variant: Sinkhorn-Knopp iterations and ordering ("paper": exp
        start, column then row normalisation, ends on rows; "v4": row-softmax start, ends on
        columns, eps 1e-6).
    sinkhorn_newton_steps: damped Newton steps polishing the last Sinkhorn iterate
        (`v41jax.mhc.sinkhorn`): 4 (the default) leaves rows and columns summing to 1 within
        ~4e-7 from the identity-like start, where 20 plain iterations leave columns off by
        4e-4 to 4e-3; its backward is the projection's implicit gradient. 0 is the plain
        iteration: a config saved before this field existed loads with 0, so old runs keep
        their numerics (`LEGACY_DEFAULTS`).
    alpha_init: initial value of the scalar gates alpha_pre, alpha_post, alpha_res.
    single_pass_impl: the single pass's implementation: "xla" (pure JAX, default), "pallas"
        (the kernel of v41jax/kernels/mhc_single_pass for this backend) or "auto" (the
        kernel on GPU/TPU when it takes the shape, else XLA). Default "xla" until the
        compiled kernels have been checked on hardware.
    """

    n_streams: int = 0
    form: Form = "reference"
    residual: ResidualKind = "mhc"
    sinkhorn_iters: int = 20
    sinkhorn_variant: SinkhornVariant = "paper"
    sinkhorn_newton_steps: int = 4
    alpha_init: float = 0.01
    single_pass_impl: SinglePassImpl = "xla"

    def __post_init__(self):
        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"MHCConfig: {msg}")

        require(self.n_streams >= 0, f"n_streams={self.n_streams} must be >= 0 (0 = off)")
        require(self.form in FORMS, f"form={self.form!r} not in {FORMS}")
        require(
            self.residual in RESIDUAL_KINDS, f"residual={self.residual!r} not in {RESIDUAL_KINDS}"
        )
        require(
            self.single_pass_impl in SINGLE_PASS_IMPLS,
            f"single_pass_impl={self.single_pass_impl!r} not in {SINGLE_PASS_IMPLS}",
        )
        require(self.sinkhorn_iters >= 1, f"sinkhorn_iters={self.sinkhorn_iters} must be >= 1")
        require(
            isinstance(self.sinkhorn_newton_steps, int) and self.sinkhorn_newton_steps >= 0,
            f"sinkhorn_newton_steps={self.sinkhorn_newton_steps!r} must be an int >= 0",
        )
        require(
            self.sinkhorn_variant in SINKHORN_VARIANTS,
            f"sinkhorn_variant={self.sinkhorn_variant!r} not in {SINKHORN_VARIANTS}",
        )

    @property
    def enabled(self) -> bool:
        return self.n_streams >= 1
