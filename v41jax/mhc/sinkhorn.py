"""Sinkhorn-Knopp projection of [..., n, n] logits onto (near) doubly-stochastic matrices.

mHC (arXiv 2512.24880) constrains the residual mixing matrix H_res to the
Birkhoff polytope: non-negative, every row and every column summing to 1. A doubly-stochastic
matrix has spectral norm <= 1 and products of them stay doubly stochastic, so the composite
residual gain across depth stays ~1. Two orderings are implemented (`variant`):

"paper" (mHC paper, eq. 9): `M_0 = exp(L - max(L))` (the max over each matrix is subtracted
    for overflow safety; it cancels in the normalisations), then `num_iters` times: divide
    every column by its sum, then every row by its sum. Ends on rows, so rows sum to 1 to
    float rounding and columns to within the iteration budget's accuracy. No eps.
"v4" (DeepSeek-V4 `hc_split_sinkhorn`): `M = softmax_row(L) + eps` (a row softmax is the exp
    start plus the first row normalisation), `M <- M / (colsum(M) + eps)`, then
    `num_iters - 1` times: `M <- M / (rowsum(M) + eps)`, `M <- M / (colsum(M) + eps)`, with
    eps = 1e-6. Ends on columns, so columns sum to ~1 and rows to the budget's accuracy.

Both run in float32 whatever the input dtype, and return float32. n = 1 returns exactly 1
(the only 1 x 1 doubly-stochastic matrix) for both variants; the v4 eps would otherwise leave
it at 1 - 1e-6.

`sinkhorn_knopp` has a custom VJP that saves only the input logits and re-runs the iterations
under `jax.vjp` in the backward pass, so the memory kept between forward and backward does not
grow with `num_iters`. `sinkhorn_knopp_unrolled` is the plain autodiff reference (a Python
loop, every iterate stored) that tests compare gradients against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

VARIANTS = ("paper", "v4")
V4_EPS = 1e-6


def _check(logits: jax.Array, num_iters: int, variant: str) -> None:
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"sinkhorn_knopp: logits must have shape [..., n, n], got {tuple(logits.shape)}"
        )
    if variant not in VARIANTS:
        raise ValueError(f"sinkhorn_knopp: variant={variant!r} not in {VARIANTS}")
    if int(num_iters) < 1:
        raise ValueError(f"sinkhorn_knopp: num_iters={num_iters} must be >= 1")


def _normalise_cols(m: jax.Array, eps: float) -> jax.Array:
    return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)


def _normalise_rows(m: jax.Array, eps: float) -> jax.Array:
    return m / (jnp.sum(m, axis=-1, keepdims=True) + eps)


def _start(logits: jax.Array, variant: str) -> jax.Array:
    """The first iterate in float32: `exp(L - max L)` ("paper") or `softmax_row(L) + eps` ("v4")."""
    l32 = logits.astype(jnp.float32)
    if variant == "paper":
        # The max cancels in the first normalisation, so its gradient is exactly zero.
        m = jax.lax.stop_gradient(jnp.max(l32, axis=(-2, -1), keepdims=True))
        return jnp.exp(l32 - m)
    return _normalise_cols(jax.nn.softmax(l32, axis=-1) + V4_EPS, V4_EPS)


def _step(m: jax.Array, variant: str) -> jax.Array:
    """One Sinkhorn iteration: columns then rows ("paper"), rows then columns ("v4")."""
    if variant == "paper":
        return _normalise_rows(_normalise_cols(m, 0.0), 0.0)
    return _normalise_cols(_normalise_rows(m, V4_EPS), V4_EPS)


def _num_steps(num_iters: int, variant: str) -> int:
    # v4's start already contains the first (row, column) pair.
    return num_iters if variant == "paper" else num_iters - 1


def _sinkhorn_loop(logits: jax.Array, num_iters: int, variant: str) -> jax.Array:
    """The iterations as a `fori_loop` (compact HLO); differentiable since the count is static."""
    m = _start(logits, variant)
    return jax.lax.fori_loop(0, _num_steps(num_iters, variant), lambda _, mm: _step(mm, variant), m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sinkhorn_recompute(logits: jax.Array, num_iters: int, variant: str) -> jax.Array:
    return _sinkhorn_loop(logits, num_iters, variant)


def _sinkhorn_fwd(logits, num_iters, variant):
    # Residuals: the logits only. The iterates are recomputed in the backward pass.
    return _sinkhorn_loop(logits, num_iters, variant), logits


def _sinkhorn_bwd(num_iters, variant, logits, g_NxN):
    _, vjp = jax.vjp(lambda z: _sinkhorn_loop(z, num_iters, variant), logits)
    return vjp(g_NxN)


_sinkhorn_recompute.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)
# jit caches the trace per (shape, dtype, num_iters, variant), so eager callers (tests, one-off
# diagnostics) do not retrace the loop on every call; under an outer jit it is inlined.
_sinkhorn_jit = jax.jit(_sinkhorn_recompute, static_argnums=(1, 2))


def sinkhorn_knopp(
    logits_xNxN: jax.Array, num_iters: int = 20, variant: str = "paper"
) -> jax.Array:
    """Sinkhorn-Knopp projection `[..., n, n] -> float32 [..., n, n]`, recomputing backward.

    See the module docstring for the two orderings. The gradient equals autodiff of the
    unrolled loop (`sinkhorn_knopp_unrolled`); the cotangent comes back in the input's dtype.
    """
    _check(logits_xNxN, num_iters, variant)
    if logits_xNxN.shape[-1] == 1:
        # [1] is the only 1 x 1 doubly-stochastic matrix; the gradient is zero.
        return jnp.ones(logits_xNxN.shape, jnp.float32)
    return _sinkhorn_jit(logits_xNxN, int(num_iters), variant)


def sinkhorn_knopp_unrolled(
    logits_xNxN: jax.Array, num_iters: int = 20, variant: str = "paper"
) -> jax.Array:
    """Same values as `sinkhorn_knopp`, differentiated by plain autodiff of a Python loop."""
    _check(logits_xNxN, num_iters, variant)
    if logits_xNxN.shape[-1] == 1:
        return jnp.ones(logits_xNxN.shape, jnp.float32)
    m = _start(logits_xNxN, variant)
    for _ in range(_num_steps(int(num_iters), variant)):
        m = _step(m, variant)
    return m
