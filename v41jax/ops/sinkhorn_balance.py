"""The Sinkhorn balance of an update matrix: DeepSeek-V4.1's optimizer for embedding tables.

V4.1 trains its Engram tables, the token embedding and the output head with a
"Sinkhorn-balanced" update (technical report, section 2.5): Nesterov momentum, then the
momentum matrix M [R, D] (rows = table rows / token ids, columns = features) is balanced so
that neither a frequent row nor a large feature dominates the step:

    norm_r   = ||M_r||_2                                   (row L2 norms)
    active_r = norm_r > tau * mean_r' norm_r'              ("inactive-row masking", tau = 1e-3)
    U        = M * active                                  (inactive rows get no update)
    for k in 1..K:                                         (K = 11 alternating normalisations)
        k odd:  U_r  <- U_r  / ||U_r||_2                   (every active row to unit norm)
        k even: U_:j <- U_:j / ||U_:j||_2                  (every column to unit norm)
    U        <- U / RMS(U)                                 (RMS over the active rows' entries)

and the parameter moves by -lr * gamma * U, gamma = 0.18 matching Adam's update RMS (no
weight decay). It is SinkGD's alternating row/column normalisation carried from linear layers
to tables; since K is odd the last step normalises rows, so every active row moves by the same
L2 norm sqrt(D) (before lr * gamma) whatever its gradient's scale, while the column steps
spread the step over features.

Why the RMS is taken over the active rows: a table's inactive (zeroed) rows hold no update,
and a row-sparse step sees only the rows its batch touched; over the active rows the scale of
each row's update is the same in both forms (the dense form over every row, the row-sparse form
over the touched ones), and equals the dense form's when every row is active.

`row_valid` [R] marks the rows that take part (the row-sparse form passes its padding rows as
invalid: they count in no mean, no column norm and get a zero update). Zero norms give zero,
never NaN. Works on numpy (`xp=np`, host tables) and jax arrays alike, in float32.

Rows split over devices (a row-sharded table, each shard balancing its own rows inside a
`shard_map`) pass `reduce=lambda x: jax.lax.psum(x, axes)`: every sum over rows (the row-norm
total and count, the column sums of squares, the RMS total) is then taken over all shards,
so the shards together compute the unsharded balance.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

SINKHORN_TAU = 1e-3  # inactive rows: norm <= tau * the mean row norm
SINKHORN_ITERS = 11  # alternating normalisations, rows first (odd: rows, even: columns)
SINKHORN_GAMMA = 0.18  # learning-rate scale matching Adam's update RMS


def _safe_divide(x, norm, xp):
    """x / norm where norm > 0, else 0 (a zero row or column stays zero)."""
    positive = norm > 0
    return xp.where(positive, x / xp.where(positive, norm, 1), 0)


def sinkhorn_balance(
    m: Any,
    row_valid: Any | None = None,
    *,
    tau: float = SINKHORN_TAU,
    iters: int = SINKHORN_ITERS,
    xp: Any = jnp,
    reduce: Any = None,
) -> Any:
    """The balanced update U [R, D] of the momentum matrix `m` [R, D] (equations above).

    row_valid: optional bool [R]; rows marked False take no part and come out zero.
    tau: inactive-row threshold relative to the mean row norm of the valid rows.
    iters: K alternating normalisations (row first); K = 0 only masks and scales.
    reduce: completes a sum over rows held elsewhere (psum over the row shards); identity
        when the rows are all here.
    """
    total = (lambda x: x) if reduce is None else reduce
    if m.ndim != 2:
        raise ValueError(f"sinkhorn_balance takes a [rows, features] matrix, got shape {m.shape}")
    if iters < 0 or int(iters) != iters:
        raise ValueError(f"sinkhorn_balance iters={iters!r}: expected an int >= 0")
    if not tau >= 0:
        raise ValueError(f"sinkhorn_balance tau={tau!r}: expected >= 0")
    u = m.astype(xp.float32)
    rows = u.shape[0]
    valid = xp.ones((rows,), bool) if row_valid is None else xp.asarray(row_valid, bool)
    if valid.shape != (rows,):
        raise ValueError(f"row_valid has shape {valid.shape}, expected ({rows},)")
    u = xp.where(valid[:, None], u, 0)
    norms = xp.sqrt(xp.sum(u * u, axis=1))
    count = xp.maximum(total(xp.sum(valid.astype(xp.float32))), 1)
    mean = total(xp.sum(norms)) / count
    active = valid & (norms > tau * mean)
    u = xp.where(active[:, None], u, 0)
    for k in range(1, iters + 1):
        if k % 2:  # odd: each row to unit norm (its features are all here)
            norm = xp.sqrt(xp.sum(u * u, axis=1, keepdims=True))
        else:  # even: each column to unit norm, over the rows of every shard
            norm = xp.sqrt(total(xp.sum(u * u, axis=0, keepdims=True)))
        u = _safe_divide(u, norm, xp)
    entries = total(xp.sum(active.astype(xp.float32))) * u.shape[1]
    rms = xp.sqrt(total(xp.sum(u * u)) / xp.maximum(entries, 1))
    return _safe_divide(u, rms, xp).astype(xp.float32)


def sinkhorn_balanced_momentum(
    momentum: float = 0.95,
    *,
    tau: float = SINKHORN_TAU,
    iters: int = SINKHORN_ITERS,
    rows_last: Any = False,
) -> optax.GradientTransformation:
    """The dense Sinkhorn-balanced update as an optax transform (scale it by -lr * gamma).

    Per 2-D leaf G [R, D] (or [D, R] where `rows_last` says so: an output head's kernel,
    whose columns are the token ids), with Nesterov momentum mu = `momentum`:

        M_t = mu M_{t-1} + G_t,    N_t = G_t + mu M_t,    update = sinkhorn_balance(N_t)

    `optax.trace(nesterov=True)` keeps M (state: one buffer of the parameter's size, against
    Adam's two); the balance is `sinkhorn_balance` above, over every row. `rows_last` is a
    bool or a pytree of bools matching the params (or a callable of the params giving one).
    A leaf that is not 2-D is an error naming its shape: balance needs rows and columns.
    """

    def balance(g, last):
        if g.ndim != 2:
            raise ValueError(f"the Sinkhorn-balanced update needs 2-D parameters, got {g.shape}")
        if last:
            return sinkhorn_balance(g.T, tau=tau, iters=iters).T.astype(g.dtype)
        return sinkhorn_balance(g, tau=tau, iters=iters).astype(g.dtype)

    def update_fn(updates, state, params=None):
        last = rows_last(params) if callable(rows_last) else rows_last
        if isinstance(last, bool):
            return jax.tree.map(lambda g: balance(g, last), updates), state
        return jax.tree.map(balance, updates, last), state

    balance_step = optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
    return optax.chain(optax.trace(decay=momentum, nesterov=True), balance_step)
