"""Pallas kernel of one Single-Pass mHC step: a grid over blocks of tokens.

Each grid step loads a [bt, n, C] block of X_l and a [bt, C] block of y = F_l(h_l) once,
and writes X_{l+1} [bt, n, C], the next sub-layer's input h_{l+1} [bt, C] (mixed with the
lagged pre-mapping and RMS-normalised) and, when ``phi`` is given, the next coefficients'
statistics ``vec(X_{l+1}) phi`` [bt, K] and ``sum X_{l+1}^2`` [bt, 1]. HBM traffic per token
is therefore (n+1)C read + (n+1)C written (+ n^2 + 2n coefficients and K + 1 statistics),
the ideal bound of REFERENCE.md §2; ``phi`` [n, C, K] has a constant index map, so it is
fetched once, not per token. The equations are in ``reference.py``; arithmetic is fp32.
The token count must be a multiple of ``block_tokens`` (``api.py`` pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def _kernel(*refs, n: int, with_norm: bool, with_stats: bool, eps: float):
    x_ref, y_ref, hres_ref, hpost_ref, apre_ref, *rest = refs
    scale_ref = rest.pop(0) if with_norm else None
    phi_ref = rest.pop(0) if with_stats else None
    xo_ref, h_ref, *stat_refs = rest
    y = y_ref[...].astype(jnp.float32)  # [bt, C]
    hres = hres_ref[...].astype(jnp.float32)  # [bt, n*n], row-major (i, j)
    hpost = hpost_ref[...].astype(jnp.float32)  # [bt, n]
    apre = apre_ref[...].astype(jnp.float32)  # [bt, n]
    xs = [x_ref[:, j, :].astype(jnp.float32) for j in range(n)]
    mixed = None
    proj = sumsq = None
    # n is small (4): unrolled loops of [bt, C] FMAs keep everything in registers/SRAM.
    for i in range(n):
        xi = hpost[:, i : i + 1] * y
        for j in range(n):
            xi = xi + hres[:, i * n + j : i * n + j + 1] * xs[j]
        xi_store = xi.astype(xo_ref.dtype)
        xo_ref[:, i, :] = xi_store
        # The statistics and the next input use the stored (rounded) stream, so they equal
        # the coefficients a later pass would compute from X_{l+1} itself.
        xi = xi_store.astype(jnp.float32)
        term = apre[:, i : i + 1] * xi
        mixed = term if mixed is None else mixed + term
        if with_stats:
            p = jnp.dot(xi, phi_ref[i].astype(jnp.float32), precision=lax.Precision.HIGHEST)
            s = jnp.sum(xi * xi, axis=-1, keepdims=True)
            proj = p if proj is None else proj + p
            sumsq = s if sumsq is None else sumsq + s
    if with_norm:
        inv = lax.rsqrt(jnp.mean(mixed * mixed, axis=-1, keepdims=True) + eps)
        mixed = mixed * inv * scale_ref[...].astype(jnp.float32)
    h_ref[...] = mixed.astype(h_ref.dtype)
    if with_stats:
        stat_refs[0][...] = proj
        stat_refs[1][...] = sumsq


def single_pass_pallas(
    x_NxnxC: jax.Array,
    y_NxC: jax.Array,
    h_res_Nxnn: jax.Array,
    h_post_Nxn: jax.Array,
    a_pre_Nxn: jax.Array,
    norm_scale_1xC: jax.Array | None,
    phi_nxCxK: jax.Array | None,
    *,
    out_dtype,
    eps: float,
    block_tokens: int,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """``(x_new [N,n,C], h_next [N,C][, proj [N,K], sumsq [N,1]])`` for N % block_tokens == 0.

    h_res comes flattened to [N, n*n]; norm_scale as [1, C]; phi as [n, C, K].
    """
    num, n, c = x_NxnxC.shape
    bt = block_tokens
    with_norm, with_stats = norm_scale_1xC is not None, phi_nxCxK is not None
    tok = lambda *tail: pl.BlockSpec((bt, *tail), lambda t: (t,) + (0,) * len(tail))
    whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
    in_specs = [tok(n, c), tok(c), tok(n * n), tok(n), tok(n)]
    operands = [x_NxnxC, y_NxC, h_res_Nxnn, h_post_Nxn, a_pre_Nxn]
    if with_norm:
        in_specs.append(whole((1, c)))
        operands.append(norm_scale_1xC)
    out_shape = [
        jax.ShapeDtypeStruct((num, n, c), x_NxnxC.dtype),
        jax.ShapeDtypeStruct((num, c), out_dtype),
    ]
    out_specs = [tok(n, c), tok(c)]
    if with_stats:
        k = phi_nxCxK.shape[-1]
        in_specs.append(whole((n, c, k)))
        operands.append(phi_nxCxK)
        out_shape += [
            jax.ShapeDtypeStruct((num, k), jnp.float32),
            jax.ShapeDtypeStruct((num, 1), jnp.float32),
        ]
        out_specs += [tok(k), tok(1)]
    kernel = functools.partial(
        _kernel, n=n, with_norm=with_norm, with_stats=with_stats, eps=float(eps)
    )
    return pl.pallas_call(
        kernel,
        grid=(num // bt,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
    )(*operands)
