"""Single-Pass mHC: the lagged pre-mapping and one memory pass per sub-layer (arXiv 2512.24880).

The lagged formulation. Sub-layers l = 0..L-1 act on the residual state X_l [n, C] per
token. Each has its own coefficient parameters ``params_l`` = {phi [nC, n^2+2n],
norm_scale [nC], alpha [3], bias [n^2+2n]} and an input-norm scale g_l [C] (or None).
The coefficients of X_l, ``(A_l, C_l, B_l) = (H_pre, H_post, H_res)(X_l; params_l)``,
are those of the paper (sigmoid, 2 sigmoid, Sinkhorn-Knopp), but the sub-layer input uses
the PREVIOUS sub-layer's pre-mapping:

    h_l     = RMSNorm(A_{l-1} X_l; g_l)          A_{-1} = e_0 (one-hot on stream 0)
    X_{l+1} = B_l X_l + C_l^T F_l(h_l)
    h_L     = RMSNorm(A_{L-1} X_L; g_L)          (the readout; g_L may be None)

Why lagged: A_l is known before sub-layer l's pass (it comes from X_l), so the pass that
writes X_{l+1} can also write h_{l+1} = RMSNorm(A_l X_{l+1}) without reading X_{l+1} again.
The paper's form, h_l = A_l X_l, would need the coefficients of X_{l+1} (which need all of
X_{l+1}) before h_{l+1} could be formed: a second pass.

One pass (``single_pass_step``, kernel in ``v41jax.kernels.mhc_single_pass``) at the end of
sub-layer l reads X_l and y = F_l(h_l) once, writes X_{l+1} and h_{l+1}, and accumulates
``proj = vec(X_{l+1}) phi'_{l+1}`` [n^2 + 2n] and ``sumsq = sum X_{l+1}^2`` with
phi' = diag(norm_scale) phi (the coefficient RMSNorm weight folded into phi). The next
coefficients then need only these numbers ("project first, divide by r after"):

    r = sqrt(sumsq / (nC) + eps);  logits = alpha * (proj / r) + bias
    H_pre = sigmoid(logits[:n]);  H_post = 2 sigmoid(logits[n:2n]);
    H_res = SinkhornKnopp(logits[2n:].reshape(n, n))
    ("hc": logits = alpha * tanh(proj / r) + bias, used as they are, as in ``reference.py``)

so Sinkhorn runs on n^2 + 2n values per token and never touches the [n, C] state.
``single_pass_forward`` runs a stack this way; ``single_pass_forward_reference`` runs the
same lagged equations step by step with ``mhc_coefficients`` computed from X_l directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from v41jax import ops, sharding
from v41jax.kernels.mhc_single_pass import mhc_single_pass, single_pass_step_reference
from v41jax.kernels.mhc_single_pass.reference import rms_norm_f32
from v41jax.mhc.config import MHCConfig
from v41jax.mhc.reference import RMS_EPS, mhc_coefficients
from v41jax.mhc.sinkhorn import sinkhorn_knopp

__all__ = [
    "coefficients_from_stats",
    "folded_phi",
    "one_hot_pre",
    "single_pass_forward",
    "single_pass_forward_reference",
    "single_pass_step",
    "single_pass_step_reference",
    "stream_stats",
]


def folded_phi(params: dict) -> jax.Array:
    """phi' = diag(norm_scale) phi, fp32 [nC, n^2 + 2n]: RMSNorm(v) phi = (v phi') / r."""
    return params["norm_scale"].astype(jnp.float32)[:, None] * params["phi"].astype(jnp.float32)


def one_hot_pre(lead: tuple[int, ...], n: int) -> jax.Array:
    """A_{-1}: the layer-0 pre-mapping, one-hot on stream 0, fp32 [*lead, n]."""
    return jnp.broadcast_to(jax.nn.one_hot(0, n, dtype=jnp.float32), (*lead, n))


def stream_stats(x_BxTxNxC: jax.Array, phi_folded: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(vec(X) phi' [B, T, K], sum X^2 [B, T])`` in fp32: the stats of X_0 (one pass)."""
    v = x_BxTxNxC.astype(jnp.float32).reshape(*x_BxTxNxC.shape[:-2], -1)
    proj = jnp.matmul(v, phi_folded, precision=lax.Precision.HIGHEST)
    return proj, jnp.sum(v * v, axis=-1)


def coefficients_from_stats(
    params: dict, proj_BxTxK: jax.Array, sumsq_BxT: jax.Array, cfg: MHCConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(H_pre [B,T,n], H_post [B,T,n], H_res [B,T,n,n])`` fp32 from the pass statistics.

    Equal to ``mhc_coefficients(params, X, cfg)`` for the X the statistics came from.
    """
    n = cfg.n_streams
    nc = params["phi"].shape[0]
    inv_r = ops.inv_rms_from_sumsq(sumsq_BxT, nc, RMS_EPS)
    z = proj_BxTxK.astype(jnp.float32) * inv_r[..., None]
    if cfg.residual == "hc":  # HC's dynamic part is tanh-squashed and used linearly
        z = jnp.tanh(z)
    alpha = params["alpha"].astype(jnp.float32)
    bias = params["bias"].astype(jnp.float32)
    pre = alpha[0] * z[..., :n] + bias[:n]
    post = alpha[1] * z[..., n : 2 * n] + bias[n : 2 * n]
    res = (alpha[2] * z[..., 2 * n :] + bias[2 * n :]).reshape(*z.shape[:-1], n, n)
    if cfg.residual == "hc":
        return pre, post, res
    res = sinkhorn_knopp(res, cfg.sinkhorn_iters, cfg.sinkhorn_variant, cfg.sinkhorn_newton_steps)
    return jax.nn.sigmoid(pre), 2.0 * jax.nn.sigmoid(post), res


def single_pass_step(
    x_BxTxNxC: jax.Array,
    y_BxTxC: jax.Array,
    h_res: jax.Array,
    h_post: jax.Array,
    a_pre: jax.Array,
    phi_next: jax.Array | None = None,
    norm_scale_next: jax.Array | None = None,
    *,
    norm_eps: float = 1e-6,
    out_dtype=None,
    impl: str = "xla",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One pass: ``(X_{l+1}, h_{l+1}, proj_{l+1}, sumsq_{l+1})``; pure JAX by default.

    a_pre is A_l (the H_pre of X_l), phi_next the folded phi' of sub-layer l+1 (None: no
    statistics), norm_scale_next g_{l+1}. See ``v41jax.kernels.mhc_single_pass``.

    Under an active multi-device mesh (``jax.set_mesh``) a kernel impl ("pallas", "auto")
    runs per device inside a ``shard_map`` over the batch axes: a Pallas call cannot be
    partitioned by GSPMD, and the step is per token, so each device's rows need nothing
    from the others. A batch the axes do not divide is computed whole on every device.
    """
    step = functools.partial(
        mhc_single_pass, norm_eps=norm_eps, out_dtype=out_dtype, impl=impl, interpret=interpret
    )
    args = (x_BxTxNxC, y_BxTxC, h_res, h_post, a_pre, phi_next, norm_scale_next)
    mesh = jax.sharding.get_abstract_mesh()
    if impl in ("xla", "reference") or mesh.empty or mesh.size == 1:
        return step(*args)
    rows = P(sharding.split_axes(mesh, "batch", x_BxTxNxC.shape[0]) or None)
    smap = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(rows,) * 5 + (P(), P()),
        out_specs=rows,
        check_vma=False,  # the Pallas call carries no varying-axes annotation
    )
    return smap(*args)


SublayerFn = Callable[[jax.Array], jax.Array]


def _norm_scales(norm_scales, num_layers):
    scales = [None] * (num_layers + 1) if norm_scales is None else list(norm_scales)
    if len(scales) != num_layers + 1:
        raise ValueError(
            f"single_pass: norm_scales needs L + 1 = {num_layers + 1} entries (one per "
            f"sub-layer input and one for the readout), got {len(scales)}"
        )
    return scales


def single_pass_forward(
    params_seq: Sequence[dict],
    x0_BxTxNxC: jax.Array,
    sublayer_fns: Sequence[SublayerFn],
    cfg: MHCConfig,
    norm_scales: Sequence[jax.Array | None] | None = None,
    *,
    norm_eps: float = 1e-6,
    compute_dtype=None,
    impl: str = "xla",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Run L sub-layers in the lagged single-pass form -> ``(X_L, h_L)``.

    sublayer_fns[l] maps h_l [B, T, C] (already mixed and normalised) to y [B, T, C];
    norm_scales has L + 1 entries [C] or None. Passes: one stats pass over X_0, then one
    pass per sub-layer.
    """
    num_layers = len(sublayer_fns)
    if len(params_seq) != num_layers:
        raise ValueError(f"single_pass: {len(params_seq)} params for {num_layers} sub-layers")
    scales = _norm_scales(norm_scales, num_layers)
    x = x0_BxTxNxC
    *lead, n, _ = x.shape
    out_dtype = x.dtype if compute_dtype is None else compute_dtype
    proj, sumsq = stream_stats(x, folded_phi(params_seq[0]))
    h = rms_norm_f32(x[..., 0, :].astype(jnp.float32), scales[0], norm_eps).astype(out_dtype)
    for layer in range(num_layers):
        a_pre, h_post, h_res = coefficients_from_stats(params_seq[layer], proj, sumsq, cfg)
        y = sublayer_fns[layer](h)
        last = layer + 1 == num_layers
        phi_next = None if last else folded_phi(params_seq[layer + 1])
        x, h, proj, sumsq = single_pass_step(
            x,
            y,
            h_res,
            h_post,
            a_pre,
            phi_next,
            scales[layer + 1],
            norm_eps=norm_eps,
            out_dtype=out_dtype,
            impl=impl,
            interpret=interpret,
        )
    return x, h


def single_pass_forward_reference(
    params_seq: Sequence[dict],
    x0_BxTxNxC: jax.Array,
    sublayer_fns: Sequence[SublayerFn],
    cfg: MHCConfig,
    norm_scales: Sequence[jax.Array | None] | None = None,
    *,
    norm_eps: float = 1e-6,
    compute_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """The lagged equations step by step: coefficients from X_l by ``mhc_coefficients``
    (normalise first, then project), mix, norm, F, update, each stage materialised."""
    num_layers = len(sublayer_fns)
    scales = _norm_scales(norm_scales, num_layers)
    x = x0_BxTxNxC
    *lead, n, _ = x.shape
    out_dtype = x.dtype if compute_dtype is None else compute_dtype
    a_prev = one_hot_pre(tuple(lead), n)
    hi = lax.Precision.HIGHEST
    for layer in range(num_layers):
        h_pre, h_post, h_res = mhc_coefficients(params_seq[layer], x, cfg, project_first=False)
        x32 = x.astype(jnp.float32)
        mixed = jnp.einsum("...j,...jc->...c", a_prev, x32, precision=hi)
        h = rms_norm_f32(mixed, scales[layer], norm_eps).astype(out_dtype)
        y = sublayer_fns[layer](h).astype(jnp.float32)
        res = jnp.einsum("...ij,...jc->...ic", h_res, x32, precision=hi)
        x = (res + h_post[..., :, None] * y[..., None, :]).astype(x.dtype)
        a_prev = h_pre
    mixed = jnp.einsum("...j,...jc->...c", a_prev, x.astype(jnp.float32), precision=hi)
    return x, rms_norm_f32(mixed, scales[num_layers], norm_eps).astype(out_dtype)
