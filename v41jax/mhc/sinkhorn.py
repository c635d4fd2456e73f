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


# Inside this module matrices are laid out [n, n, *batch] (row index first, then column):
# the batch (tokens) on the minor axis. A TPU tiles an array's last two dimensions by
# (8, 128), so [tokens, 4, 4] intermediates would be padded 64-fold in memory and traffic;
# the public functions move the matrix axes to the front on entry and back on exit.


def _normalise_cols(m: jax.Array, eps: float) -> jax.Array:
    return m / (jnp.sum(m, axis=0, keepdims=True) + eps)


def _normalise_rows(m: jax.Array, eps: float) -> jax.Array:
    return m / (jnp.sum(m, axis=1, keepdims=True) + eps)


def _start(logits: jax.Array, variant: str) -> jax.Array:
    """The first iterate in float32: `exp(L - max L)` ("paper") or `softmax_row(L) + eps` ("v4")."""
    l32 = logits.astype(jnp.float32)
    if variant == "paper":
        # The max cancels in the first normalisation, so its gradient is exactly zero.
        m = jax.lax.stop_gradient(jnp.max(l32, axis=(0, 1), keepdims=True))
        return jnp.exp(l32 - m)
    return _normalise_cols(jax.nn.softmax(l32, axis=1) + V4_EPS, V4_EPS)


def _step(m: jax.Array, variant: str) -> jax.Array:
    """One Sinkhorn iteration: columns then rows ("paper"), rows then columns ("v4")."""
    if variant == "paper":
        return _normalise_rows(_normalise_cols(m, 0.0), 0.0)
    return _normalise_cols(_normalise_rows(m, V4_EPS), V4_EPS)


def _num_steps(num_iters: int, variant: str) -> int:
    # v4's start already contains the first (row, column) pair.
    return num_iters if variant == "paper" else num_iters - 1


def _solve_spd(a: list[list], b: list) -> list:
    """x with a x = b for a batch of small symmetric positive definite systems, given as
    nested lists of batch arrays (or 0.0 for structural zeros).

    Gaussian elimination without pivoting (stable for SPD), unrolled over the static size so
    that every operation is elementwise over the batch: XLA vectorises it across tokens,
    where a batched LU (``jnp.linalg.solve``) pivots with gathers per matrix.
    """
    size = len(b)
    a = [list(row) for row in a]
    b = list(b)
    is_zero = lambda v: isinstance(v, float) and v == 0.0
    for k in range(size):
        for i in range(k + 1, size):
            if is_zero(a[i][k]):
                continue
            lik = a[i][k] / a[k][k]
            for j in range(k + 1, size):
                if not is_zero(a[k][j]):
                    a[i][j] = a[i][j] - lik * a[k][j]
            b[i] = b[i] - lik * b[k]
    x = [None] * size
    for i in reversed(range(size)):
        acc = b[i]
        for j in range(i + 1, size):
            if not is_zero(a[i][j]):
                acc = acc - a[i][j] * x[j]
        x[i] = acc / a[i][i]
    return x


def _hessian_reduced(p: jax.Array) -> list[list]:
    """[[diag(rowsum P), P], [P^T, diag(colsum P)]] less its last row and column (the gauge
    g_n = 0), as nested lists of batch arrays; symmetric positive definite for P > 0."""
    n = p.shape[0]
    rows, cols = jnp.sum(p, axis=1), jnp.sum(p, axis=0)
    h = [[0.0] * (2 * n - 1) for _ in range(2 * n - 1)]
    for i in range(n):
        h[i][i] = rows[i]
        for j in range(n - 1):
            h[i][n + j] = h[n + j][i] = p[i, j]
    for j in range(n - 1):
        h[n + j][n + j] = cols[j]
    return h


def _potentials(d: list, n: int) -> tuple[jax.Array, jax.Array]:
    """(f [n, *b], g [n, *b]) from the reduced unknowns (f_1..f_n, g_1..g_{n-1}); g_n = 0."""
    return jnp.stack(d[:n]), jnp.stack([*d[n:], jnp.zeros_like(d[0])])


_STEP_SIZES = (1.0, 0.5, 0.25, 0.125)


def _newton_polish(m: jax.Array, steps: int) -> jax.Array:
    """diag(e^f) M diag(e^g) after `steps` damped Newton steps on F(f, g) (module docstring)
    from f = g = 0; M [n, n, *b] positive float32."""
    n = m.shape[0]
    f = jnp.zeros(m.shape[1:], jnp.float32)
    g = jnp.zeros(m.shape[1:], jnp.float32)

    def scaled(f, g):
        p = m * jnp.exp(f[:, None] + g[None, :])
        rows, cols = jnp.sum(p, axis=1), jnp.sum(p, axis=0)
        err = jnp.sum(jnp.square(rows - 1), 0) + jnp.sum(jnp.square(cols - 1), 0)
        return p, rows, cols, err

    for _ in range(steps):
        p, rows, cols, err = scaled(f, g)
        grad = [rows[i] - 1 for i in range(n)] + [cols[j] - 1 for j in range(n - 1)]
        df, dg = _potentials([-v for v in _solve_spd(_hessian_reduced(p), grad)], n)
        best_f, best_g, best = f, g, err
        for t in _STEP_SIZES:
            tf, tg = f + t * df, g + t * dg
            trial = scaled(tf, tg)[3]
            better = trial < best
            best = jnp.where(better, trial, best)
            best_f = jnp.where(better[None], tf, best_f)
            best_g = jnp.where(better[None], tg, best_g)
        f, g = best_f, best_g
    return m * jnp.exp(f[:, None] + g[None, :])


def _sinkhorn_loop(
    logits: jax.Array, num_iters: int, variant: str, newton_steps: int = 0
) -> jax.Array:
    """The iterations as a `fori_loop` (compact HLO); differentiable since the count is static.
    Then `newton_steps` of the polish and the variant's last normalisation again.
    Layout [n, n, *batch] in and out."""
    m = _start(logits, variant)
    m = jax.lax.fori_loop(0, _num_steps(num_iters, variant), lambda _, mm: _step(mm, variant), m)
    return _polish(m, variant, newton_steps)


def _polish(m: jax.Array, variant: str, newton_steps: int) -> jax.Array:
    """The last iterate after `newton_steps` of the polish and the variant's last
    normalisation again (unchanged for newton_steps=0)."""
    if not newton_steps:
        return m
    m = _newton_polish(m, newton_steps)
    return _normalise_rows(m, 0.0) if variant == "paper" else _normalise_cols(m, 0.0)


def _projection_vjp(p: jax.Array, g: jax.Array) -> jax.Array:
    """The cotangent of the kernel's log, log K, for P = diag(e^f) K diag(e^g) doubly
    stochastic (implicit differentiation of the row and column constraints):

        dl/dlog K = P * (G - alpha 1^T - 1 beta^T),  H [alpha; beta] = [rowsum(P*G); colsum(P*G)]

    with H the Hessian of `_hessian_reduced` (gauge beta_n = 0; alpha_i + beta_j does not
    depend on the gauge). Exact for the converged projection, whatever iterations led to it.
    Layout [n, n, *b].
    """
    n = p.shape[0]
    pg = p * g.astype(jnp.float32)
    row_pg, col_pg = jnp.sum(pg, axis=1), jnp.sum(pg, axis=0)
    rhs = [row_pg[i] for i in range(n)] + [col_pg[j] for j in range(n - 1)]
    alpha, beta = _potentials(_solve_spd(_hessian_reduced(p), rhs), n)
    return p * (g - alpha[:, None] - beta[None, :])


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
    start = lambda z: jax.nn.softmax(z.astype(jnp.float32), axis=1) + V4_EPS
    k, vjp = jax.vjp(start, logits)
    return vjp(g_logk / k)


_sinkhorn_recompute.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)
# jit caches the trace per (shape, dtype, num_iters, variant), so eager callers (tests, one-off
# diagnostics) do not retrace the loop on every call; under an outer jit it is inlined.
_sinkhorn_jit = jax.jit(_sinkhorn_recompute, static_argnums=(1, 2, 3))


def _matrix_first(x_xNxN: jax.Array) -> jax.Array:
    return jnp.moveaxis(x_xNxN, (-2, -1), (0, 1))


def _matrix_last(x_NxNx: jax.Array) -> jax.Array:
    return jnp.moveaxis(x_NxNx, (0, 1), (-2, -1))


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
    out = _sinkhorn_jit(_matrix_first(logits_xNxN), int(num_iters), variant, int(newton_steps))
    return _matrix_last(out)


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
    m = _start(_matrix_first(logits_xNxN), variant)
    for _ in range(_num_steps(int(num_iters), variant)):
        m = _step(m, variant)
    return _matrix_last(_polish(m, variant, int(newton_steps)))
