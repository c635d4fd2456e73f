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
  "pallas"     ``kernel.single_pass_pallas``: one tiled pass over token blocks (pass
               ``interpret=True`` on CPU).
  "reference"  ``single_pass_step_reference``: each stage materialised.
  "auto"       "xla" on CPU, "pallas" on GPU/TPU when the kernel takes the shapes.
Gradients: "xla" and "reference" by autodiff; "pallas" by a ``jax.custom_vjp`` whose
backward recomputes the "xla" forward and takes its VJP (the pass is memory bound, so the
recompute costs one more read of the inputs, and nothing but the inputs is saved).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from v41jax.kernels.mhc_single_pass import kernel as _kernel
from v41jax.kernels.mhc_single_pass.reference import rms_norm_f32, single_pass_step_reference

IMPLS = ("auto", "xla", "pallas", "reference")


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
    # XLA's cost analysis (CPU, n=4, C=1024), but 3.5x faster (8 vs 29 us/token).
    v = xn32.reshape(*xn32.shape[:-2], n * c)
    proj = jnp.matmul(v, phi.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    sumsq = jnp.sum(xn32 * xn32, axis=(-2, -1))
    return x_new, h_next, proj, sumsq


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static choices of one call (hashable: a nondiff argument of the custom_vjp)."""

    norm_eps: float
    out_dtype: Any
    block_tokens: int
    interpret: bool
    pad_k_to: int | None  # GPU: Triton block shapes must be powers of two


def _xla_of(plan: _Plan):
    return lambda *a: _step_xla(*a, norm_eps=plan.norm_eps, out_dtype=plan.out_dtype)


def _pallas_forward(plan: _Plan, x, y, h_res, h_post, a_pre, phi, norm_scale):
    *lead, n, c = x.shape
    num = max(1, int(jnp.size(y)) // c)
    bt = plan.block_tokens
    padded = -(-num // bt) * bt
    pad = lambda a: jnp.pad(a, [(0, padded - num)] + [(0, 0)] * (a.ndim - 1))
    flat = lambda a, *tail: pad(a.reshape(num, *tail))
    phi3 = None
    k = None
    if phi is not None:
        k = phi.shape[-1]
        phi3 = phi.reshape(n, c, k)
        if plan.pad_k_to and plan.pad_k_to > k:
            phi3 = jnp.pad(phi3, [(0, 0), (0, 0), (0, plan.pad_k_to - k)])
    outs = _kernel.single_pass_pallas(
        flat(x, n, c),
        flat(y, c),
        flat(h_res, n * n),
        flat(h_post, n),
        flat(a_pre, n),
        None if norm_scale is None else norm_scale.reshape(1, c),
        phi3,
        out_dtype=plan.out_dtype,
        eps=plan.norm_eps,
        block_tokens=bt,
        interpret=plan.interpret,
    )
    x_new = outs[0][:num].reshape(*lead, n, c)
    h_next = outs[1][:num].reshape(*lead, c)
    if phi is None:
        return x_new, h_next, None, None
    return x_new, h_next, outs[2][:num, :k].reshape(*lead, k), outs[3][:num, 0].reshape(lead)


_pallas_step = jax.custom_vjp(_pallas_forward, nondiff_argnums=(0,))


def _pallas_fwd(plan, *args):
    return _pallas_forward(plan, *args), args


def _pallas_bwd(plan, args, g):
    _, vjp = jax.vjp(_xla_of(plan), *args)
    return vjp(g)


_pallas_step.defvjp(_pallas_fwd, _pallas_bwd)


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


def _pallas_shape_error(backend: str, n: int, c: int, block_tokens: int) -> str | None:
    pow2 = lambda v: v > 0 and v & (v - 1) == 0
    if backend in ("gpu", "cuda") and not (pow2(n) and pow2(c) and pow2(block_tokens)):
        return (
            f"the GPU (Triton) kernel needs power-of-two n, C and block_tokens, got n={n}, "
            f"C={c}, block_tokens={block_tokens}"
        )
    if backend == "tpu" and block_tokens % 8:
        return f"the TPU kernel needs block_tokens % 8 == 0, got {block_tokens}"
    return None


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
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One Single-Pass mHC step -> ``(x_new, h_next, proj, sumsq)`` (see ``reference.py``).

    Shapes: x [..., n, C], y [..., C], h_res [..., n, n], h_post [..., n], a_pre [..., n],
    phi [n*C, K] or None (no statistics), norm_scale [C] or None (no normalisation).
    """
    _validate(x, y, h_res, h_post, a_pre, phi, norm_scale)
    if impl not in IMPLS:
        raise ValueError(f"mhc_single_pass: impl must be one of {IMPLS}, got {impl!r}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    n, c = x.shape[-2:]
    backend = jax.default_backend()
    num = int(y.size) // c
    bt = block_tokens or min(256, max(8, -(-num // 8) * 8))
    if block_tokens is not None and (not isinstance(block_tokens, int) or block_tokens < 1):
        raise ValueError(
            f"mhc_single_pass: block_tokens must be a positive int, got {block_tokens!r}"
        )
    if impl == "auto":
        ok = backend != "cpu" and _pallas_shape_error(backend, n, c, bt) is None
        impl = "pallas" if ok else "xla"
    args = (x, y, h_res, h_post, a_pre, phi, norm_scale)
    if impl == "reference":
        return single_pass_step_reference(*args, norm_eps=norm_eps, out_dtype=out_dtype)
    plan = _Plan(
        norm_eps=float(norm_eps),
        out_dtype=out_dtype,
        block_tokens=bt,
        interpret=bool(interpret),
        pad_k_to=None,
    )
    if impl == "xla":
        return _xla_of(plan)(*args)
    if not interpret:
        if backend == "cpu":
            raise ValueError("mhc_single_pass: impl='pallas' on CPU needs interpret=True")
        err = _pallas_shape_error(backend, n, c, bt)
        if err:
            raise ValueError(f"mhc_single_pass: {err}")
        if backend in ("gpu", "cuda") and phi is not None:
            k = phi.shape[-1]
            plan = dataclasses.replace(plan, pad_k_to=1 << (k - 1).bit_length())
    return _pallas_step(plan, *args)
