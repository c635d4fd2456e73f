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

Near the identity, where mHC starts (its static bias puts ~0.99 on the diagonal), Sinkhorn
converges slowly: its rate is set by the second singular value of the limit, which is ~1 for
a matrix close to a permutation. At 20 iterations and n = 4 the sums the variant does not end
on stay off by 4e-4 (logits perturbed by 0.01 N(0, 1)) to 4e-3 (0.1); 160 iterations still
leave 1e-4 at 0.1. `newton_steps` (default 4) polishes the last iterate M with damped Newton
steps on its scaling potentials: P = diag(e^f) M diag(e^g) with (f, g) the minimiser of the
convex F(f, g) = sum_ij M_ij e^(f_i + g_j) - sum f - sum g, whose gradient is the row and
column residuals (r, c) and whose Hessian is [[diag(rowsum P), P], [P^T, diag(colsum P)]].
With the gauge fixed (g_n = 0) the (2n-1) x (2n-1) system is symmetric positive definite
and is solved by unrolled elimination (`_solve_spd`). Each step tries the step sizes 1, 1/2,
1/4, 1/8 and keeps the one with the smallest squared residual, or no step if none improves
it (undamped Newton diverges on spiky matrices, e.g. logits of 3 N(0, 1)). The variant's own
last normalisation follows, so its sums stay exact to rounding; both rows and columns then
sum to 1 within ~4e-7 at perturbations 0.01 to 1 (`tests/mhc/test_sinkhorn_convergence.py`).
`newton_steps=0` is the plain iteration (runs saved before the polish existed load with 0,
see `v41jax.config.mhc`).

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


def _check(logits: jax.Array, num_iters: int, variant: str, newton_steps: int = 0) -> None:
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"sinkhorn_knopp: logits must have shape [..., n, n], got {tuple(logits.shape)}"
        )
    if variant not in VARIANTS:
        raise ValueError(f"sinkhorn_knopp: variant={variant!r} not in {VARIANTS}")
    if int(num_iters) < 1:
        raise ValueError(f"sinkhorn_knopp: num_iters={num_iters} must be >= 1")
    if int(newton_steps) < 0:
        raise ValueError(f"sinkhorn_knopp: newton_steps={newton_steps} must be >= 0")


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


def _solve_spd(a_xMxM: jax.Array, b_xM: jax.Array) -> jax.Array:
    """x with a x = b for a batch of small symmetric positive definite systems.

    Gaussian elimination without pivoting (stable for SPD), unrolled over the static size
    m so that every operation is elementwise over the batch: XLA vectorises it across
    tokens, where a batched LU (``jnp.linalg.solve``) pivots with gathers per matrix.
    """
    m = a_xMxM.shape[-1]
    a = [[a_xMxM[..., i, j] for j in range(m)] for i in range(m)]
    b = [b_xM[..., i] for i in range(m)]
    for k in range(m):
        for i in range(k + 1, m):
            lik = a[i][k] / a[k][k]
            for j in range(k + 1, m):
                a[i][j] = a[i][j] - lik * a[k][j]
            b[i] = b[i] - lik * b[k]
    x = [None] * m
    for i in reversed(range(m)):
        acc = b[i]
        for j in range(i + 1, m):
            acc = acc - a[i][j] * x[j]
        x[i] = acc / a[i][i]
    return jnp.stack(x, axis=-1)


_STEP_SIZES = (1.0, 0.5, 0.25, 0.125)


def _newton_polish(m_xNxN: jax.Array, steps: int) -> jax.Array:
    """diag(e^f) M diag(e^g) after `steps` damped Newton steps on F(f, g) (module docstring)
    from f = g = 0; M [..., n, n] positive float32."""
    n = m_xNxN.shape[-1]
    f = jnp.zeros(m_xNxN.shape[:-1], jnp.float32)
    g = jnp.zeros(m_xNxN.shape[:-1], jnp.float32)

    def scaled(f, g):
        p = m_xNxN * jnp.exp(f[..., :, None] + g[..., None, :])
        rows, cols = jnp.sum(p, axis=-1), jnp.sum(p, axis=-2)
        err = jnp.sum(jnp.square(rows - 1), -1) + jnp.sum(jnp.square(cols - 1), -1)
        return p, rows, cols, err

    for _ in range(steps):
        p, rows, cols, err = scaled(f, g)
        # unknowns (f_1..f_n, g_1..g_{n-1}): the gauge g_n = 0 fixed
        grad = jnp.concatenate([rows - 1, cols[..., : n - 1] - 1], axis=-1)
        d = -_solve_spd(_hessian_reduced(p), grad)
        df, dg = d[..., :n], jnp.pad(d[..., n:], [(0, 0)] * (d.ndim - 1) + [(0, 1)])
        best_f, best_g, best = f, g, err
        for t in _STEP_SIZES:
            tf, tg = f + t * df, g + t * dg
            trial = scaled(tf, tg)[3]
            better = trial < best
            best = jnp.where(better, trial, best)
            best_f = jnp.where(better[..., None], tf, best_f)
            best_g = jnp.where(better[..., None], tg, best_g)
        f, g = best_f, best_g
    return m_xNxN * jnp.exp(f[..., :, None] + g[..., None, :])


def _sinkhorn_loop(
    logits: jax.Array, num_iters: int, variant: str, newton_steps: int = 0
) -> jax.Array:
    """The iterations as a `fori_loop` (compact HLO); differentiable since the count is static.
    Then `newton_steps` of the polish and the variant's last normalisation again."""
    m = _start(logits, variant)
    m = jax.lax.fori_loop(0, _num_steps(num_iters, variant), lambda _, mm: _step(mm, variant), m)
    if not newton_steps:
        return m
    m = _newton_polish(m, newton_steps)
    if variant == "paper":
        return _normalise_rows(m, 0.0)
    return _normalise_cols(m, 0.0)


def _hessian_reduced(p_xNxN: jax.Array) -> jax.Array:
    """[[diag(rowsum P), P], [P^T, diag(colsum P)]] less its last row and column (the gauge
    g_n = 0): [..., 2n-1, 2n-1], symmetric positive definite for P > 0."""
    n = p_xNxN.shape[-1]
    eye = jnp.eye(n, dtype=jnp.float32)
    rows, cols = jnp.sum(p_xNxN, axis=-1), jnp.sum(p_xNxN, axis=-2)
    top = jnp.concatenate([rows[..., :, None] * eye, p_xNxN[..., :, : n - 1]], axis=-1)
    bot = jnp.concatenate(
        [jnp.swapaxes(p_xNxN, -1, -2)[..., : n - 1, :], cols[..., : n - 1, None] * eye[:-1, :-1]],
        axis=-1,
    )
    return jnp.concatenate([top, bot], axis=-2)


def _projection_vjp(p_xNxN: jax.Array, g_xNxN: jax.Array) -> jax.Array:
    """The cotangent of the kernel's log, log K, for P = diag(e^f) K diag(e^g) doubly
    stochastic (implicit differentiation of the row and column constraints):

        dl/dlog K = P * (G - alpha 1^T - 1 beta^T),  H [alpha; beta] = [rowsum(P*G); colsum(P*G)]

    with H the Hessian of `_hessian_reduced` (gauge beta_n = 0; alpha_i + beta_j does not
    depend on the gauge). Exact for the converged projection, whatever iterations led to it.
    """
    n = p_xNxN.shape[-1]
    pg = p_xNxN * g_xNxN.astype(jnp.float32)
    rhs = jnp.concatenate([jnp.sum(pg, axis=-1), jnp.sum(pg, axis=-2)[..., : n - 1]], axis=-1)
    sol = _solve_spd(_hessian_reduced(p_xNxN), rhs)
    alpha = sol[..., :n]
    beta = jnp.pad(sol[..., n:], [(0, 0)] * (sol.ndim - 1) + [(0, 1)])
    return p_xNxN * (g_xNxN - alpha[..., :, None] - beta[..., None, :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _sinkhorn_recompute(
    logits: jax.Array, num_iters: int, variant: str, newton_steps: int
) -> jax.Array:
    return _sinkhorn_loop(logits, num_iters, variant, newton_steps)


def _sinkhorn_fwd(logits, num_iters, variant, newton_steps):
    # Residuals: the logits only. The iterates are recomputed in the backward pass.
    return _sinkhorn_loop(logits, num_iters, variant, newton_steps), logits


def _sinkhorn_bwd(num_iters, variant, newton_steps, logits, g_NxN):
    loop = lambda z: _sinkhorn_loop(z, num_iters, variant, newton_steps)
    if not newton_steps:  # the plain iteration: autodiff of its (recomputed) loop
        return jax.vjp(loop, logits)[1](g_NxN)
    # Polished to convergence: the projection's own gradient (implicit), not the loop's.
    p = loop(logits)
    g_logk = _projection_vjp(p, g_NxN)
    if variant == "paper":  # K = exp(L - max L): dl/dL = dl/dlog K (the max cancels)
        return (g_logk.astype(logits.dtype),)
    # v4: K = softmax_row(L) + eps (its column normalisation is one more diagonal scaling)
    start = lambda z: jax.nn.softmax(z.astype(jnp.float32), axis=-1) + V4_EPS
    k, vjp = jax.vjp(start, logits)
    return vjp(g_logk / k)


_sinkhorn_recompute.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)
# jit caches the trace per (shape, dtype, num_iters, variant), so eager callers (tests, one-off
# diagnostics) do not retrace the loop on every call; under an outer jit it is inlined.
_sinkhorn_jit = jax.jit(_sinkhorn_recompute, static_argnums=(1, 2, 3))

NEWTON_STEPS = 4  # the default polish: both sums to ~4e-7 from the identity (docstring)


def sinkhorn_knopp(
    logits_xNxN: jax.Array,
    num_iters: int = 20,
    variant: str = "paper",
    newton_steps: int = NEWTON_STEPS,
) -> jax.Array:
    """Sinkhorn-Knopp projection `[..., n, n] -> float32 [..., n, n]`, recomputing backward.

    See the module docstring for the two orderings and the Newton polish (`newton_steps=0`:
    the plain iteration). The gradient equals autodiff of the unrolled loop
    (`sinkhorn_knopp_unrolled`); the cotangent comes back in the input's dtype.
    """
    _check(logits_xNxN, num_iters, variant, newton_steps)
    if logits_xNxN.shape[-1] == 1:
        # [1] is the only 1 x 1 doubly-stochastic matrix; the gradient is zero.
        return jnp.ones(logits_xNxN.shape, jnp.float32)
    return _sinkhorn_jit(logits_xNxN, int(num_iters), variant, int(newton_steps))


def sinkhorn_knopp_unrolled(
    logits_xNxN: jax.Array,
    num_iters: int = 20,
    variant: str = "paper",
    newton_steps: int = NEWTON_STEPS,
) -> jax.Array:
    """Same values as `sinkhorn_knopp`, differentiated by plain autodiff of a Python loop."""
    _check(logits_xNxN, num_iters, variant, newton_steps)
    if logits_xNxN.shape[-1] == 1:
        return jnp.ones(logits_xNxN.shape, jnp.float32)
    m = _start(logits_xNxN, variant)
    for _ in range(_num_steps(int(num_iters), variant)):
        m = _step(m, variant)
    if not newton_steps:
        return m
    m = _newton_polish(m, int(newton_steps))
    return _normalise_rows(m, 0.0) if variant == "paper" else _normalise_cols(m, 0.0)
