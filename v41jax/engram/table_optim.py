"""Row-sparse optimizers for Engram tables: each step touches only the rows the batch read.

A table T [R, C] read at the unique rows u [U] of a batch gets the gradient g [U, C] of those
rows (the rows of `T[u]`, summed over every position that read them); rows the batch did not
read have no gradient and, here, no update and no state change. Per touched row r (lr = the
step's learning rate, decoupled weight decay wd):

    sparse_adam      k_r += 1                              (the row's own step count)
                     m_r = b1 m_r + (1 - b1) g_r,   v_r = b2 v_r + (1 - b2) g_r^2
                     T_r -= lr (m_r / (1 - b1^k_r)) / (sqrt(v_r / (1 - b2^k_r)) + eps)
                            + lr wd T_r
    rowwise_adagrad  a_r += mean_c g_rc^2                  (one accumulator per row)
                     T_r -= lr g_r / (sqrt(a_r) + eps) + lr wd T_r

    sinkhorn_sparse  m_r <- mu^(s - s_r - 1) m_r               (the skipped steps' decay)
                     m_r <- mu m_r + g_r,   n_r = g_r + mu m_r   (Nesterov, mu = momentum)
                     T_r -= lr gamma balance(n)_r + lr wd T_r,   s_r <- s
                     (s the step taken, s_r the row's last one; balance = the Sinkhorn
                     balance of the touched rows' matrix n [U, C]: `v41jax.ops.sinkhorn_balance`)

`sparse_adam` is lazy Adam: a row's moments and bias correction advance only on the steps that
read it, so each row follows exactly Adam run on its own sequence of gradients (the dense
AdamW of the same table would also decay the moments of unread rows and move them). State:
m, v [R, C] and k [R, 1] (2C + 1 values per row). `rowwise_adagrad` keeps one float per row
(state 1/C of the table), the memory-light choice of large embedding systems; it equals dense
row-wise Adagrad exactly, since an unread row's update there is zero too.

`sinkhorn_sparse` is V4.1's Sinkhorn-balanced table update restricted to the rows a step
touches: one momentum buffer m [R, C] (1x the table, against Adam's 2x) and the step s_r
[R, 1] at which each row last moved. An untouched row's momentum is decayed on its next touch
by mu per skipped step, so the momentum a touched row enters the balance with is exactly the
dense form's (whose untouched rows see g = 0 and decay every step); lazily, without the
decay, a row read once in a thousand steps would re-enter with the stale momentum of its last
read. What differs from the dense form (`v41jax.ops.sinkhorn_balanced_momentum`, optimizer
"sinkhorn") is by design: the dense form balances every row, so a row untouched for a few
steps keeps moving on its decaying momentum until its norm falls under tau x the mean, and
those rows enter the mean row norm and the column norms; the row-sparse form balances the
touched rows alone and leaves every other row (and its state) bit-identical. With every row
touched every step the two are the same update. gamma = 0.18 (`SINKHORN_GAMMA`) scales the
balanced update (unit RMS) to Adam's update size, so `lr` is the Adam learning rate the
other table optimizers take.

Why not optax: optax transforms map a dense gradient tree to a dense update tree, so a table
update is O(R C) per step whatever the batch read; these functions gather and scatter the U
rows only (in place when the caller donates the state), O(U C) per step.

Row ids u may hold the fill value R (padding of a fixed-size unique): those entries are
dropped (never read, never written). The same functions run on numpy arrays (`xp=np`); both
forms agree to float32 rounding. Host tables run them jitted on the gathered rows
(`gathered_update_program`), the program device sinkhorn_sparse tables run too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.config.schema import DENSE_TABLE_OPTIMIZERS, TABLE_OPTIMIZERS
from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balance

SPARSE_TABLE_OPTIMIZERS = tuple(k for k in TABLE_OPTIMIZERS if k not in DENSE_TABLE_OPTIMIZERS)


def check_kind(kind: str) -> None:
    if kind not in SPARSE_TABLE_OPTIMIZERS:
        raise ValueError(
            f"table optimizer {kind!r} is not row-sparse; choose one of {SPARSE_TABLE_OPTIMIZERS}"
        )


def init_state(kind: str, num_rows: int, row_dim: int, xp: Any = jnp) -> dict:
    """Zero state of a [num_rows, row_dim] table (float32; the step count int32)."""
    check_kind(kind)
    if kind == "sparse_adam":
        return {
            "m": xp.zeros((num_rows, row_dim), xp.float32),
            "v": xp.zeros((num_rows, row_dim), xp.float32),
            "k": xp.zeros((num_rows, 1), xp.int32),
        }
    if kind == "sinkhorn_sparse":
        return {
            "m": xp.zeros((num_rows, row_dim), xp.float32),
            "s": xp.zeros((num_rows, 1), xp.int32),
        }
    return {"acc": xp.zeros((num_rows, 1), xp.float32)}


def state_bytes(kind: str, num_rows: int, row_dim: int) -> int:
    """Bytes of the optimizer state of one [num_rows, row_dim] table (dense adam: 2 moments)."""
    per_row = {
        "adam": 8 * row_dim,
        "sinkhorn": 4 * row_dim,
        "sparse_adam": 8 * row_dim + 4,
        "rowwise_adagrad": 4,
        "sinkhorn_sparse": 4 * row_dim + 4,
    }
    if kind not in per_row:
        raise ValueError(f"table optimizer {kind!r} not in {TABLE_OPTIMIZERS}")
    return per_row[kind] * num_rows


def _gather(x, rows_U, xp):
    if xp is np:
        return x[rows_U]
    return x.at[rows_U].get(mode="fill", fill_value=0)


def _scatter(x, rows_U, values, xp):
    if xp is np:  # numpy: drop the padding ids, write in place
        keep = rows_U < x.shape[0]
        x[rows_U[keep]] = values[keep]
        return x
    return x.at[rows_U].set(values.astype(x.dtype), mode="drop")


def sparse_update(
    kind: str,
    table_RxC,
    state: dict,
    rows_U,
    grads_UxC,
    lr,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.95,
    step: Any = None,
    reduce: Any = None,
    xp: Any = jnp,
):
    """(new table, new state) after one step at the unique rows `rows_U` (module doc).

    rows_U: int [U], distinct except for the fill value R (ignored); grads_UxC: float [U, C].
    With numpy (`xp=np`) the table and state are updated in place and returned.
    sinkhorn_sparse only: momentum (mu), step (the 1-based step being taken, int or int32
    scalar; required), reduce (sums over rows held by other shards: `sinkhorn_balance`).
    """
    check_kind(kind)
    if kind == "sinkhorn_sparse" and step is None:
        raise ValueError("sparse_update: sinkhorn_sparse needs the step being taken (step=)")
    if xp is np:
        rows_U = np.asarray(rows_U)
        valid = rows_U < table_RxC.shape[0]
        rows_U, grads_UxC = rows_U[valid], np.asarray(grads_UxC)[valid]
    if grads_UxC.shape != (rows_U.shape[0], table_RxC.shape[1]):
        raise ValueError(
            f"sparse_update: grads shape {grads_UxC.shape} != (rows {rows_U.shape[0]}, "
            f"table width {table_RxC.shape[1]})"
        )
    g = grads_UxC.astype(xp.float32)
    t = _gather(table_RxC, rows_U, xp).astype(xp.float32)
    if kind == "sparse_adam":
        k = _gather(state["k"], rows_U, xp) + 1
        m = b1 * _gather(state["m"], rows_U, xp) + (1 - b1) * g
        v = b2 * _gather(state["v"], rows_U, xp) + (1 - b2) * g * g
        kf = k.astype(xp.float32)
        m_hat = m / (1 - xp.power(xp.float32(b1), kf))
        v_hat = v / (1 - xp.power(xp.float32(b2), kf))
        new_t = t - lr * (m_hat / (xp.sqrt(v_hat) + eps) + weight_decay * t)
        state = {
            "m": _scatter(state["m"], rows_U, m, xp),
            "v": _scatter(state["v"], rows_U, v, xp),
            "k": _scatter(state["k"], rows_U, k, xp),
        }
    elif kind == "sinkhorn_sparse":
        s = xp.asarray(step, xp.int32)
        last = _gather(state["s"], rows_U, xp)
        skipped = xp.where(last > 0, xp.maximum(s - last - 1, 0), 0).astype(xp.float32)
        mu = xp.float32(momentum)
        m = _gather(state["m"], rows_U, xp) * xp.power(mu, skipped)
        m = mu * m + g
        nesterov = g + mu * m
        valid = rows_U < table_RxC.shape[0]
        balanced = sinkhorn_balance(nesterov, valid, xp=xp, reduce=reduce)
        new_t = t - lr * (xp.float32(SINKHORN_GAMMA) * balanced + weight_decay * t)
        state = {
            "m": _scatter(state["m"], rows_U, m, xp),
            "s": _scatter(state["s"], rows_U, xp.broadcast_to(s, last.shape), xp),
        }
    else:
        acc = _gather(state["acc"], rows_U, xp) + xp.mean(g * g, axis=-1, keepdims=True)
        new_t = t - lr * (g / (xp.sqrt(acc) + eps) + weight_decay * t)
        state = {"acc": _scatter(state["acc"], rows_U, acc, xp)}
    return _scatter(table_RxC, rows_U, new_t, xp), state


def gathered_update_program(kind: str, **hyper):
    """The jitted `sparse_update` of rows already gathered, the one program that both host
    tables and (for sinkhorn_sparse) device tables run, so that they round alike:

        program(rows [N, C], state_rows {name: [N, ...]}, grads [N, C], lr, keep [N] bool,
                step) -> (new rows [N, C], new state rows)

    rows i with keep[i] False (the fill entries of a padded unique) take no part; their
    outputs are garbage and dropped by the caller. hyper: `sparse_update`'s keywords (b1,
    b2, eps, weight_decay, momentum).

    Why one compiled program: XLA rounds the same arithmetic differently depending on the
    program it is fused into (contracted multiply-adds, reduction orders), and the
    Sinkhorn balance amplifies a one-ulp gap into a visible one within tens of steps (each
    row's update has unit norm however small its momentum). One executable, called with the
    same inputs, gives bit-identical outputs wherever it runs the same backend."""
    return _gathered_update_program(kind, tuple(sorted(hyper.items())))


@functools.cache
def _gathered_update_program(kind: str, hyper: tuple):
    check_kind(kind)

    def update(rows, state_rows, grads, lr, keep, step):
        n = rows.shape[0]
        ids = jnp.where(keep, jnp.arange(n, dtype=jnp.int32), n)
        return sparse_update(kind, rows, state_rows, ids, grads, lr, step=step, **dict(hyper))

    return jax.jit(update)


def unique_rows(ids, num_rows: int):
    """(rows [N], slots shaped like ids): the distinct ids of `ids` (any shape, N = ids.size)
    padded with the fill value `num_rows`, and each id's index into them (rows[slots] == ids).

    A fixed size N keeps the shapes static under jit; a batch reading U < N distinct rows
    leaves N - U fill entries, which `sparse_update` drops.
    """
    flat = jnp.ravel(ids).astype(jnp.int32)
    rows, slots = jnp.unique(flat, size=flat.shape[0], fill_value=num_rows, return_inverse=True)
    return rows.astype(jnp.int32), slots.reshape(jnp.shape(ids)).astype(jnp.int32)
