"""`MHCConfig`: manifold-constrained hyper-connections around every sub-layer (REFERENCE.md §2).

`n_streams = 0` is the plain residual model (no mHC parameters). With n >= 1 the residual
state is n streams [B, T, n, C], mixed around every attention and FFN sub-layer by
`x <- H_res x + H_post^T F(H_pre x)`; n = 1 is the gated residual `x + H_post F(H_pre x)`.
"""

from __future__ import annotations

from dataclasses import dataclass

# The residual forms the backbone can train with. The paper-fused and Single-Pass forms
# (issue 4) join this tuple when they are wired into the backbone.
FORMS = ("reference",)
RESIDUAL_KINDS = ("mhc", "hc")
SINKHORN_VARIANTS = ("paper", "v4")


@dataclass(frozen=True)
class MHCConfig:
    """n_streams: residual streams n (0 = plain residual, off; 1 = gated residual).
    form: "reference": the paper's equations step by step (see FORMS).
    residual: "mhc" (H_res Sinkhorn-projected, doubly stochastic) or "hc" (unconstrained
        hyper-connections, H_res = identity-initialised free matrix: the unstable baseline).
    sinkhorn_iters, sinkhorn_variant: Sinkhorn-Knopp iterations and ordering ("paper": exp
        start, column then row normalisation, ends on rows; "v4": row-softmax start, ends on
        columns, eps 1e-6).
    alpha_init: initial value of the scalar gates alpha_pre, alpha_post, alpha_res.
    """

    n_streams: int = 0
    form: str = "reference"
    residual: str = "mhc"
    sinkhorn_iters: int = 20
    sinkhorn_variant: str = "paper"
    alpha_init: float = 0.01

    def __post_init__(self):
        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"MHCConfig: {msg}")

        require(self.n_streams >= 0, f"n_streams={self.n_streams} must be >= 0 (0 = off)")
        require(self.form in FORMS, f"form={self.form!r} not in {FORMS}")
        require(
            self.residual in RESIDUAL_KINDS, f"residual={self.residual!r} not in {RESIDUAL_KINDS}"
        )
        require(self.sinkhorn_iters >= 1, f"sinkhorn_iters={self.sinkhorn_iters} must be >= 1")
        require(
            self.sinkhorn_variant in SINKHORN_VARIANTS,
            f"sinkhorn_variant={self.sinkhorn_variant!r} not in {SINKHORN_VARIANTS}",
        )

    @property
    def enabled(self) -> bool:
        return self.n_streams >= 1
