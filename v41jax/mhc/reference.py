"""Reference mHC: the paper's equations step by step, as pure functions of explicit params.

The equations, the three forms and the traffic table: docs/mhc.md.

mHC, "Manifold-Constrained Hyper-Connections" (arXiv 2512.24880). The
residual state is n streams, x of shape [n, C] per token; around every sub-layer F

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)          H_pre, H_post: 1 x n; H_res: n x n

with per-token coefficients (fp32 throughout):

    v = vec(x_l) (1 x nC),   v' = RMSNorm(v) = v / r * scale,   r = sqrt(mean(v^2) + eps)
    [pre~, post~, res~] = alpha * (v' phi) + b           phi: nC x (n^2 + 2n), b: n^2 + 2n
    H_pre = sigmoid(pre~),  H_post = 2 sigmoid(post~),  H_res = SinkhornKnopp(res~ as n x n)

alpha is three scalars (alpha_pre, alpha_post, alpha_res) broadcast over their parts. Column
layout of phi and b: [pre (n) | post (n) | res (n^2, row-major: res[i, j] at 2n + i n + j)].
`H_res[i, j]` is the weight of stream j in new stream i.

`residual="hc"` is the unconstrained Hyper-Connections baseline (arXiv 2409.19606, as restated
in the mHC paper's eq. 5): dynamic + static, `H = alpha * tanh(v' phi) + b`, used as is (no
sigmoid, no Sinkhorn): H_pre = pre~, H_post = post~, H_res = res~ with b_res = I.

Shape suffixes: B batch, T length, N streams (n), C width, K = n^2 + 2n coefficients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from v41jax import ops
from v41jax.mhc.config import MHCConfig
from v41jax.mhc.sinkhorn import sinkhorn_knopp

RMS_EPS = 1e-6
RES_IDENTITY = 0.99  # diagonal of H_res at init (mHC); off-diagonals share the remaining 0.01
HIGHEST = jax.lax.Precision.HIGHEST  # coefficients are fp32: no reduced-precision matmul passes

Params = dict[str, jax.Array]


def num_coeffs(n: int) -> int:
    """K = n^2 + 2n coefficients per token: n pre, n post, n^2 res."""
    return n * n + 2 * n


# ----------------------------------------------------------------------------- init


def static_bias(n: int, residual: str = "mhc", res_identity: float = RES_IDENTITY) -> jax.Array:
    """The static bias b [K] that sets the coefficients at init (when the dynamic part is ~0).

    With `expand_streams` every stream starts as the same embedding h. While all streams are
    equal to h, H_res has unit row sums and H_post is the same on every stream, the update
    `H_res x + H_post^T y` keeps them equal, each becoming h + H_post_i y. So, for mHC:
      H_post = 2 sigmoid(0) = 1 per stream: every stream then gets exactly `+ y`, the plain
        residual update, at the sigmoid's steepest point.
      H_pre = sigmoid(logit(1/n)) = 1/n per stream: the sub-layer input `sum_i H_pre_i x_i`
        is then exactly h, so at init the model equals the plain pre-norm residual model
        (up to the small dynamic part). Uniform rather than one-hot: equal at init, but
        every stream gets gradient. For n = 1 sigmoid cannot reach 1, so b = 0 (H_pre = 1/2):
        pre-norm sub-layers are scale invariant, so only the direction of H_pre x matters.
      H_res: diagonal logit d, off-diagonal 0. exp(res~) then has equal row and column sums,
        so Sinkhorn returns it normalised exactly: diagonal `res_identity` (0.99), off-diagonal
        (1 - res_identity)/(n - 1). Near identity without saturating the Sinkhorn gradient.
    For "hc" (HC's static init): H_pre = 1/n, H_post = 1, H_res = I, linear.
    """
    if residual == "hc":
        pre = jnp.full((n,), 1.0 / n)
        post = jnp.ones((n,))
        res = jnp.eye(n)
    else:
        pre = jnp.full((n,), -math.log(n - 1) if n > 1 else 0.0)  # logit(1/n)
        post = jnp.zeros((n,))
        d = math.log(res_identity * (n - 1) / (1.0 - res_identity)) if n > 1 else 0.0
        res = d * jnp.eye(n)
    return jnp.concatenate([pre, post, res.reshape(-1)]).astype(jnp.float32)


def phi_init_std(n: int, width: int) -> float:
    """phi ~ N(0, 1/(nC)): `v' phi` is then O(1) and alpha (0.01) alone sets its weight."""
    return 1.0 / math.sqrt(n * width)


def mhc_params_init(
    key: jax.Array, n: int, width: int, cfg: MHCConfig, *, phi_std: float | None = None
) -> Params:
    """Params: phi [nC, K], norm_scale [nC] (ones), alpha [3] (cfg.alpha_init), bias [K]."""
    std = phi_init_std(n, width) if phi_std is None else phi_std
    return {
        "phi": std * jax.random.normal(key, (n * width, num_coeffs(n)), jnp.float32),
        "norm_scale": jnp.ones((n * width,), jnp.float32),
        "alpha": jnp.full((3,), cfg.alpha_init, jnp.float32),
        "bias": static_bias(n, cfg.residual),
    }


# ----------------------------------------------------------------------------- coefficients


def _check_streams(x: jax.Array, n: int, what: str) -> None:
    if x.ndim < 2 or x.shape[-2] != n:
        raise ValueError(
            f"{what}: expected x of shape [..., n={n}, C], got {tuple(x.shape)} "
            f"(stream axis has {x.shape[-2] if x.ndim >= 2 else 'no'} entries, n_streams={n})"
        )


def mhc_coefficients(
    params: Params,
    x_BxTxNxC: jax.Array,
    cfg: MHCConfig,
    *,
    project_first: bool = True,
    eps: float = RMS_EPS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(H_pre [B,T,N], H_post [B,T,N], H_res [B,T,N,N]), all float32, from the streams.

    project_first=False is the direct path `alpha * (RMSNorm(v) phi) + b`; project_first=True
    (the paper's cheap path) computes `(v (scale ⊙ phi)) / r` with `r = sqrt(mean(v^2) + eps)`:
    the norm scale folds into phi and the division touches K values instead of nC. Equal up
    to float rounding. Leading axes need not be [B, T]: any [..., N, C] works.
    """
    n = cfg.n_streams
    if n < 1:
        raise ValueError(f"mhc_coefficients: cfg.n_streams={n}; mHC needs n_streams >= 1")
    _check_streams(x_BxTxNxC, n, "mhc_coefficients")
    c = x_BxTxNxC.shape[-1]
    phi, scale = params["phi"].astype(jnp.float32), params["norm_scale"].astype(jnp.float32)
    if phi.shape != (n * c, num_coeffs(n)):
        raise ValueError(
            f"mhc_coefficients: phi has shape {phi.shape}, expected (n*C, n^2+2n) = "
            f"({n * c}, {num_coeffs(n)}) for n={n}, C={c}"
        )
    v_BxTxNC = x_BxTxNxC.reshape(*x_BxTxNxC.shape[:-2], n * c).astype(jnp.float32)
    if project_first:
        proj_BxTxK = jnp.matmul(v_BxTxNC, scale[:, None] * phi, precision=HIGHEST)
        proj_BxTxK = proj_BxTxK * ops.inv_rms(v_BxTxNC, eps)
    else:
        proj_BxTxK = jnp.matmul(ops.rms_norm_f32(v_BxTxNC, scale, eps), phi, precision=HIGHEST)

    alpha = params["alpha"].astype(jnp.float32)
    alpha_K = jnp.concatenate(
        [jnp.full((n,), alpha[0]), jnp.full((n,), alpha[1]), jnp.full((n * n,), alpha[2])]
    )
    dynamic_BxTxK = jnp.tanh(proj_BxTxK) if cfg.residual == "hc" else proj_BxTxK
    tilde_BxTxK = alpha_K * dynamic_BxTxK + params["bias"].astype(jnp.float32)
    pre, post = tilde_BxTxK[..., :n], tilde_BxTxK[..., n : 2 * n]
    res_BxTxNxN = tilde_BxTxK[..., 2 * n :].reshape(*tilde_BxTxK.shape[:-1], n, n)
    if cfg.residual == "hc":
        return pre, post, res_BxTxNxN
    h_res = sinkhorn_knopp(
        res_BxTxNxN, cfg.sinkhorn_iters, cfg.sinkhorn_variant, cfg.sinkhorn_newton_steps
    )
    return jax.nn.sigmoid(pre), 2.0 * jax.nn.sigmoid(post), h_res


# ----------------------------------------------------------------------------- update


def mhc_apply(
    x_BxTxNxC: jax.Array,
    sublayer_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
    coeffs: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, Any]:
    """`x_new = H_res x + H_post^T F(H_pre x)`: returns (x_new [B,T,N,C] in x's dtype, aux).

    `sublayer_fn(h_BxTxC) -> (y_BxTxC, aux)`. The sub-layer input `h = sum_i H_pre_i x_i` is
    accumulated in float32 and handed to F in x's dtype; the mixing and the add run in
    float32 and the result is cast back to x's dtype once.
    """
    h_pre, h_post, h_res = coeffs
    n = h_pre.shape[-1]
    _check_streams(x_BxTxNxC, n, "mhc_apply")
    x32 = x_BxTxNxC.astype(jnp.float32)
    h_BxTxC = jnp.einsum("...n,...nc->...c", h_pre, x32, precision=HIGHEST)
    y_BxTxC, aux = sublayer_fn(h_BxTxC.astype(x_BxTxNxC.dtype))
    if y_BxTxC.shape != h_BxTxC.shape:
        raise ValueError(
            f"mhc_apply: sublayer output shape {tuple(y_BxTxC.shape)} != its input shape "
            f"{tuple(h_BxTxC.shape)}"
        )
    mixed_BxTxNxC = jnp.einsum("...ij,...jc->...ic", h_res, x32, precision=HIGHEST)
    x_new = mixed_BxTxNxC + h_post[..., None] * y_BxTxC.astype(jnp.float32)[..., None, :]
    return x_new.astype(x_BxTxNxC.dtype), aux


def expand_streams(h_BxTxC: jax.Array, n: int) -> jax.Array:
    """[B,T,C] -> [B,T,n,C]: every stream starts as a copy of the embedding (HC, mHC)."""
    if n < 1:
        raise ValueError(f"expand_streams: n={n} must be >= 1")
    return jnp.broadcast_to(h_BxTxC[..., None, :], (*h_BxTxC.shape[:-1], n, h_BxTxC.shape[-1]))


def reduce_streams(x_BxTxNxC: jax.Array) -> jax.Array:
    """[B,T,n,C] -> [B,T,C]: the sum of the streams, as Hyper-Connections does at the output.

    At init all streams are equal (see `static_bias`), so the sum is n times the plain
    residual state; the final RMSNorm before the head removes that factor. Summed in float32.
    """
    return jnp.sum(x_BxTxNxC.astype(jnp.float32), axis=-2).astype(x_BxTxNxC.dtype)


# ----------------------------------------------------------------------------- diagnostics


def composite_gain(h_res_list: list[jax.Array]) -> dict[str, jax.Array]:
    """Amax gains of the composite residual map `P = H_res^(L) ... H_res^(1)` (mHC fig. 3/7).

    Each entry is H_res of one sub-layer, [..., n, n] (e.g. [B, T, n, n]), in depth order.
    Per token: forward gain `max_i sum_j |P_ij|` (max abs row sum: how much a stream's
    output can grow), backward gain `max_j sum_i |P_ij|` (max abs column sum: the same for
    gradients). Keys `forward_amax`/`backward_amax` are the max over tokens (the worst case,
    what blows up); `*_mean` the mean over tokens. Doubly-stochastic H_res give gains ~1;
    unconstrained HC can grow geometrically with depth.
    """
    if not h_res_list:
        raise ValueError("composite_gain: h_res_list is empty")
    p = h_res_list[0].astype(jnp.float32)
    for h in h_res_list[1:]:
        if h.shape[-2:] != p.shape[-2:]:
            raise ValueError(f"composite_gain: H_res shapes differ: {h.shape} vs {p.shape}")
        p = jnp.matmul(h.astype(jnp.float32), p, precision=HIGHEST)
    fwd = jnp.max(jnp.sum(jnp.abs(p), axis=-1), axis=-1)
    bwd = jnp.max(jnp.sum(jnp.abs(p), axis=-2), axis=-1)
    return {
        "forward_amax": jnp.max(fwd),
        "backward_amax": jnp.max(bwd),
        "forward_amax_mean": jnp.mean(fwd),
        "backward_amax_mean": jnp.mean(bwd),
    }
