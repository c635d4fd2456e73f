"""The width basis's admission rules (`schedule_verify_lengths(basis="width", admission=)`).

One width w for the batch, every active row verifies w drafts (`v41jax.dspark.decode.scheduler`):

    tau(w)        = B_active + sum_b sum_{j <= w} s[b, j]     s[b, j] = prod_{i <= j} c[b, i]
    throughput(w) = tau(w) / cost(B (1 + w))                   w = w_0 .. K

w_0 = 0 when the cost table has an entry at B tokens (width 0: a plain decode step, no drafter
pass, tau(0) = B_active), else w_0 = 1.

admission="global": the argmax of throughput over every w (first on ties), then verify K
unless the best beats throughput(K) by more than min_gain. It reads every c_1 .. c_K, so it
keeps the output law only when the confidences are fixed before any draft is sampled (the
"hidden" confidence head).

admission="early_stop": a stopping rule. Start at w = w_0 and extend w -> w + 1 while
throughput(w + 1) > throughput(w); stop at the first w where it does not (or at K). The
decision to verify draft j = w + 1 reads tau(j), hence c_1 .. c_j of every row, and nothing
after: c_j depends on x_0 .. x_{j-1}, drawn before d_j, and other rows' drafts are independent
of this row's. So given the history, d_j is still drawn from q_j with fresh randomness
whatever is decided, and the exact verifier keeps the target's law with the DSpark paper's
(arXiv 2607.05147) "prev_token" confidences, which read the previous sampled draft. There is
no min_gain fallback: "verify K unless the best is worth it" compares with throughput(K),
which reads c_K and so the drafts up to d_{K-1}: stopping at w < K would then depend on drafts
after w (the paper's Appendix A: a global rule over such confidences is not lossless). The
price is the first local maximum of throughput instead of the global one (a staircase cost
curve has several).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

Admission = Literal["global", "early_stop"]
ADMISSIONS: tuple[Admission, ...] = get_args(Admission)


def first_width(cost, b: int) -> int:
    """w_0: 0 if the cost table measured a B-token step (width 0, a plain decode), else 1."""
    return 0 if b in cost.tokens else 1


def width_choice(
    surv_BxK: jax.Array,
    n_req: jax.Array,
    secs_W: jax.Array,
    w0: int,
    admission: Admission,
    min_gain,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(w int32, tau(w), throughput(w), throughput(K)) under `admission` (module docstring).

    surv: float32 [B, K] survivals (0 for finished rows and past `useful`); n_req: active rows;
    secs: float32 [K + 1 - w0] cost(B (1 + w)) for w = w0 .. K."""
    col_K = jnp.sum(surv_BxK, axis=0)
    tau_W = n_req + jnp.concatenate([jnp.zeros(1, jnp.float32), jnp.cumsum(col_K)])[w0:]
    thr_W = tau_W / secs_W
    last = thr_W.shape[0] - 1
    if admission == "global":
        best = jnp.argmax(thr_W)  # the first width on ties
        best = jnp.where(thr_W[best] > (1.0 + min_gain) * thr_W[last], best, last)
    else:  # the number of leading steps w -> w + 1 that raise the throughput
        up = thr_W[1:] > thr_W[:-1]
        best = jnp.sum(jnp.cumprod(up.astype(jnp.int32)), dtype=jnp.int32)
    w = (best + w0).astype(jnp.int32)
    return w, tau_W[best], thr_W[best], thr_W[last]
