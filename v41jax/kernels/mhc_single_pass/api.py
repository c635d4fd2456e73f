"""Entry point of one Single-Pass mHC step: validation, implementation dispatch, gradient.

``mhc_single_pass(x, y, h_res, h_post, a_pre, phi, norm_scale)`` returns
``(x_new, h_next, proj, sumsq)`` as defined in ``reference.py``: the residual update
``X_{l+1} = H_res X_l + H_post^T y``, the next sub-layer's input ``RMSNorm(a X_{l+1})`` with
the lagged pre-mapping ``a`` (the H_pre of X_l), and the statistics the next coefficients
need (``vec(X_{l+1}) phi'`` and ``sum X_{l+1}^2``).

Implementations (``impl``):
  "xla"        jnp expressions XLA fuses: on CPU one loop fusion writes X_{l+1}, and the
               next input, the projection (a dot) and sum x^2 each re-read it (XLA CPU does
               not fuse them into one pass: 22C of traffic per token at n=4 in f32, vs 10C).
  "pallas"     ``kernel.single_pass_pallas``: one pass tiled over tokens and C, the TPU
               (Mosaic) or GPU (Triton) variant by the platform the program is lowered
               for; ``interpret=True`` runs ``pallas_target``'s variant in the interpreter.
  "reference"  ``single_pass_step_reference``: each stage materialised.
  "auto"       "pallas" when lowered for TPU or CUDA and that kernel takes the shapes,
               else "xla" (CPU, other platforms); ``interpret`` is ignored.
Gradients: "xla" and "reference" by autodiff; "pallas" and "auto" by a ``jax.custom_vjp``
that saves only the inputs and runs the fused backward kernel (``backward.py``: one pass,
X_{l+1} recomputed from X and y, the phi / norm-scale gradients reduced over tokens inside
it) on the platform the program is lowered for; where that kernel cannot take the shape
(and on CPU under "auto") the backward recomputes the "xla" forward and takes its VJP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from v41jax.kernels.mhc_single_pass import backward as fused_backward
from v41jax.kernels.mhc_single_pass import kernel as _kernel
from v41jax.kernels.mhc_single_pass.dispatch import platform_call
from v41jax.kernels.mhc_single_pass.plan import TARGETS, Plan, make_plan
from v41jax.kernels.mhc_single_pass.reference import rms_norm_f32, single_pass_step_reference

IMPLS = ("auto", "xla", "pallas", "reference")
_NO_KERNEL = (
    "mhc_single_pass: impl='pallas' was lowered for a platform without a compiled kernel "
    "(CPU): pass interpret=True to run the kernel in the Pallas interpreter, or use "
    "impl='auto' / 'xla'"
)


def _step_xla(x, y, h_res, h_post, a_pre, phi, norm_scale, *, norm_eps, out_dtype):
    """The fused pure-JAX form: [..., n, C] streams built by one broadcast expression (an
    einsum would lower to a dot that does not fuse with the update)."""
    n, c = x.shape[-2:]
    x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
    h_res32 = h_res.astype(jnp.float32)
    x_new = h_post.astype(jnp.float32)[..., :, None] * y32[..., None, :]
    for j in range(n):
        x_new = x_new + h_res32[..., :, j, None] * x32[..., None, j, :]
    x_new = x_new.astype(x.dtype)
    xn32 = x_new.astype(jnp.float32)
    mixed = jnp.sum(a_pre.astype(jnp.float32)[..., :, None] * xn32, axis=-2)
    h_next = rms_norm_f32(mixed, norm_scale, norm_eps).astype(out_dtype)
    if phi is None:
        return x_new, h_next, None, None
    # A dot on the flattened streams: the same traffic as a fused multiply-and-reduce in
    # XLA's cost analysis (CPU, n=4, C=1024); chosen as the faster form on CPU, a comparison
    # no benchmark JSON records.
    v = xn32.reshape(*xn32.shape[:-2], n * c)
    proj = jnp.matmul(v, phi.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    sumsq = jnp.sum(xn32 * xn32, axis=(-2, -1))
    return x_new, h_next, proj, sumsq


def _xla_of(spec):
    return lambda *a: _step_xla(*a, norm_eps=spec.norm_eps, out_dtype=spec.out_dtype)


def _pallas_forward(plan: Plan, x, y, h_res, h_post, a_pre, phi, norm_scale):
    *lead, n, c = x.shape
    num = max(1, int(y.size) // c)
    # Triton programs are not masked at a ragged edge: the GPU kernel gets a padded token
    # axis (a copy, only when N is not a block multiple); the TPU grid takes the tail.
    padded = num if plan.target == "tpu" else -(-num // plan.block_tokens) * plan.block_tokens
    pad = lambda a: (
        a if padded == num else jnp.pad(a, [(0, padded - num)] + [(0, 0)] * (a.ndim - 1))
    )
    flat = lambda a, *tail: pad(a.reshape(num, *tail))
    phi3 = k = None
    if phi is not None:
        k = phi.shape[-1]
        phi3 = phi.astype(jnp.float32).reshape(n, c, k)
        if plan.pad_k_to and plan.pad_k_to > k:
            phi3 = jnp.pad(phi3, [(0, 0), (0, 0), (0, plan.pad_k_to - k)])
    outs = _kernel.single_pass_pallas(
        plan,
        flat(x, n, c),
        flat(y, c),
        flat(h_res.astype(jnp.float32), n * n),
        flat(h_post.astype(jnp.float32), n),
        flat(a_pre.astype(jnp.float32), n),
        None if norm_scale is None else norm_scale.astype(jnp.float32).reshape(1, c),
        phi3,
    )
    x_new = outs[0][:num].reshape(*lead, n, c)
    h_next = outs[1][:num].reshape(*lead, c)
    if phi is None:
        return x_new, h_next, None, None
    return x_new, h_next, outs[2][:num, :k].reshape(*lead, k), outs[3][:num, 0].reshape(lead)


def _pallas_backward(bplan: fused_backward.BackwardPlan, args, cot):
    """The fused backward kernel on flattened operands -> the inputs' cotangents."""
    x, y, h_res, h_post, a_pre, phi, norm_scale = args
    d_xn, d_h, d_proj, d_sumsq = cot
    *lead, n, c = x.shape
    num = max(1, int(y.size) // c)
    padded = num
    if bplan.target == "gpu":  # whole token blocks; zero cotangent rows add nothing
        padded = -(-num // bplan.block_tokens) * bplan.block_tokens
    pad = lambda a: (
        a if padded == num else jnp.pad(a, [(0, padded - num)] + [(0, 0)] * (a.ndim - 1))
    )
    flat = lambda a, *tail, dt=None: pad(a.reshape(num, *tail).astype(dt or a.dtype))
    streams = (n * c,) if bplan.flat_streams else (n, c)  # the forward kernel's layout
    phi3 = dproj = dss = None
    if phi is not None:
        k = phi.shape[-1]
        # [nC, K] -> [n, Kp, C]: K on sublanes (TPU) / the dot's inner dim (GPU), zero-padded
        phi3 = phi.astype(jnp.float32).reshape(n, c, k).transpose(0, 2, 1)
        phi3 = jnp.pad(phi3, [(0, 0), (0, bplan.k_pad - k), (0, 0)])
        dproj = jnp.pad(flat(d_proj, k, dt=jnp.float32), [(0, 0), (0, bplan.k_pad - k)])
        dss = flat(d_sumsq, 1, dt=jnp.float32)
    outs = fused_backward.single_pass_backward_pallas(
        bplan,
        flat(x, *streams),
        flat(y, c),
        flat(h_res, n * n, dt=jnp.float32),
        flat(h_post, n, dt=jnp.float32),
        flat(a_pre, n, dt=jnp.float32),
        None if norm_scale is None else norm_scale.astype(jnp.float32).reshape(1, c),
        phi3,
        flat(d_xn, *streams, dt=x.dtype),
        flat(d_h, c),
        dproj,
        dss,
    )
    dx, dy, d_res, d_post, d_pre = (o[:num] for o in outs[:5])
    rest = list(outs[5:])
    d_scale = rest.pop(0).reshape(c).astype(norm_scale.dtype) if norm_scale is not None else None
    d_phi = None
    if phi is not None:
        d_phi = rest.pop(0)[:, : phi.shape[-1], :].transpose(0, 2, 1).reshape(n * c, -1)
        d_phi = d_phi.astype(phi.dtype)
    return (
        dx.reshape(x.shape),
        dy.reshape(y.shape),
        d_res.reshape(h_res.shape).astype(h_res.dtype),
        d_post.reshape(h_post.shape).astype(h_post.dtype),
        d_pre.reshape(a_pre.shape).astype(a_pre.dtype),
        d_phi,
        d_scale,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Dispatch:
    """The compiled step: one rule per lowering platform (see ``dispatch.py``), forward and
    backward."""

    norm_eps: float
    out_dtype: Any
    per_platform: dict
    default: Any
    per_platform_bwd: dict
    default_bwd: Any


@dataclasses.dataclass(frozen=True)
class _Interpreted:
    """The kernels in the Pallas interpreter (any platform, no dispatch)."""

    plan: Plan
    bplan: fused_backward.BackwardPlan


def _forward(spec, *args):
    if isinstance(spec, _Interpreted):
        return _pallas_forward(spec.plan, *args)
    return platform_call(spec.per_platform, spec.default, _xla_of(spec), *args)


def _xla_vjp(spec, args, cot):
    xla = lambda *a: _step_xla(*a, norm_eps=spec.norm_eps, out_dtype=spec.out_dtype)
    return jax.vjp(xla, *args)[1](cot)


def _backward(spec, args, cot):
    """Residuals: the inputs only (X_{l+1} is recomputed inside the backward)."""
    if isinstance(spec, _Interpreted):
        return _pallas_backward(spec.bplan, args, cot)
    shape_fn = lambda a, g: _xla_vjp(spec, a, g)
    return platform_call(spec.per_platform_bwd, spec.default_bwd, shape_fn, args, cot)


_kernel_step = jax.custom_vjp(_forward, nondiff_argnums=(0,))
_kernel_step.defvjp(lambda spec, *args: (_forward(spec, *args), args), _backward)


def _validate(x, y, h_res, h_post, a_pre, phi, norm_scale) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"mhc_single_pass: {msg}")

    need(x.ndim >= 3, f"x must be [..., n, C] with at least one token axis, got {x.shape}")
    *lead, n, c = x.shape
    lead = tuple(lead)
    for name, arr, want in [
        ("y", y, lead + (c,)),
        ("h_res", h_res, lead + (n, n)),
        ("h_post", h_post, lead + (n,)),
        ("a_pre", a_pre, lead + (n,)),
    ]:
        need(arr.shape == want, f"{name} must have shape {want} for x {x.shape}, got {arr.shape}")
    if phi is not None:
        need(
            phi.ndim == 2 and phi.shape[0] == n * c,
            f"phi must be [n*C, K] = [{n * c}, K], got {phi.shape}",
        )
    if norm_scale is not None:
        need(norm_scale.shape == (c,), f"norm_scale must be [C] = ({c},), got {norm_scale.shape}")
    need(jnp.issubdtype(x.dtype, jnp.floating), f"x must be floating point, got {x.dtype}")


def mhc_single_pass(
    x: jax.Array,
    y: jax.Array,
    h_res: jax.Array,
    h_post: jax.Array,
    a_pre: jax.Array,
    phi: jax.Array | None = None,
    norm_scale: jax.Array | None = None,
    *,
    norm_eps: float = 1e-6,
    out_dtype=None,
    impl: str = "auto",
    interpret: bool = False,
    block_tokens: int | None = None,
    block_c: int | None = None,
    pallas_target: str = "tpu",
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One Single-Pass mHC step -> ``(x_new, h_next, proj, sumsq)`` (see ``reference.py``).

    Shapes: x [..., n, C], y [..., C], h_res [..., n, n], h_post [..., n], a_pre [..., n],
    phi [n*C, K] or None (no statistics), norm_scale [C] or None (no normalisation).
    block_tokens / block_c override the kernels' token block and C tile (the forward's and
    the fused backward's); pallas_target
    ("tpu" | "gpu") is the kernel variant run by the interpreter (interpret=True). Compiled
    (interpret=False), "pallas" and "auto" dispatch on the platform the program is lowered
    for (``dispatch.platform_call``): the TPU kernel on TPU, the GPU kernel on CUDA, and for
    "auto" the "xla" form on CPU and wherever the kernel cannot take the shape.
    """
    _validate(x, y, h_res, h_post, a_pre, phi, norm_scale)
    if impl not in IMPLS:
        raise ValueError(f"mhc_single_pass: impl must be one of {IMPLS}, got {impl!r}")
    for name, v in (("block_tokens", block_tokens), ("block_c", block_c)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"mhc_single_pass: {name} must be a positive int, got {v!r}")
    if pallas_target not in TARGETS:
        raise ValueError(
            f"mhc_single_pass: pallas_target must be one of {TARGETS}, got {pallas_target!r}"
        )
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    n, c = x.shape[-2:]
    args = (x, y, h_res, h_post, a_pre, phi, norm_scale)
    if impl == "reference":
        return single_pass_step_reference(*args, norm_eps=norm_eps, out_dtype=out_dtype)
    xla = lambda *a: _step_xla(*a, norm_eps=float(norm_eps), out_dtype=out_dtype)
    if impl == "xla":
        return xla(*args)

    # what both kernels' plans are sized by
    shape = dict(
        num=max(1, int(y.size) // c),
        n=n,
        c=c,
        k=None if phi is None else phi.shape[-1],
        x_item=x.dtype.itemsize,
        with_norm=norm_scale is not None,
        norm_eps=float(norm_eps),
        block_tokens=block_tokens,
        block_c=block_c,
    )

    def plan_for(target: str, interp: bool) -> Plan:
        return make_plan(
            target, **shape, out_item=out_dtype.itemsize, out_dtype=out_dtype, interpret=interp
        )

    def bplan_for(target: str, interp: bool) -> fused_backward.BackwardPlan:
        return fused_backward.make_backward_plan(
            target, **shape, h_item=out_dtype.itemsize, interpret=interp
        )

    if interpret and impl == "pallas":  # the interpreter runs anywhere: no dispatch
        spec = _Interpreted(plan_for(pallas_target, True), bplan_for(pallas_target, True))
        return _kernel_step(spec, *args)
    # Compiled: each platform's rule is lowered only for that platform. A kernel that cannot
    # take the shape falls back to "xla" under "auto" and is an error under "pallas"; the
    # backward falls back to the XLA VJP where its own kernel cannot take the shape.
    per_platform, per_platform_bwd, errors = {}, {}, {}
    xla_bwd = lambda a, g: _xla_vjp(spec, a, g)
    for target, platform in (("tpu", "tpu"), ("gpu", "cuda")):
        try:
            per_platform[platform] = functools.partial(_pallas_forward, plan_for(target, False))
        except ValueError as e:
            errors[platform] = str(e)
            per_platform[platform] = xla if impl == "auto" else str(e)
        try:
            bplan = bplan_for(target, False)
            per_platform_bwd[platform] = lambda a, g, bp=bplan: _pallas_backward(bp, a, g)
        except ValueError:
            per_platform_bwd[platform] = xla_bwd
    if impl == "pallas" and len(errors) == 2:
        raise ValueError("; ".join(errors.values()))
    other = xla if impl == "auto" else _NO_KERNEL
    spec = _Dispatch(
        float(norm_eps), out_dtype, {**per_platform, "cpu": other}, other,
        {**per_platform_bwd, "cpu": xla_bwd}, xla_bwd,
    )  # fmt: skip
    return _kernel_step(spec, *args)
