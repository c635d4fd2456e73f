"""The fused backward of one Single-Pass mHC step: one pass over the tokens, gradients of
everything the forward reads.

Forward, per token (``reference.py``): X' = B X + c^T y (stored in X's dtype),
m = a X' [C], h = m s g with s = (mean m^2 + eps)^(-1/2), proj = vec(X') phi, sumsq = |X'|^2.
Given the cotangents (dX' [n, C], dh [C], dproj [K], dsumsq []) the backward is

    dm    = s (dh * g) - (s^3 / C) m sum_c(m dh g)          (dm = dh without the norm)
    G_i   = dX'_i + a_i dm + phi_i dproj + 2 dsumsq X'_i      [C] per stream i
    dX_j  = sum_i B_ij G_i          dy = sum_i c_i G_i
    dB_ij = <G_i, X_j>   dc_i = <G_i, y>   da_i = <dm, X'_i>  (per token, over C)
    dg    = sum_tokens dh * m * s   dphi_i = sum_tokens dproj^T X'_i  (reduced over tokens)

The minimum traffic per token (the bound, ``backward_bound_bytes``): read X, y (X' is
recomputed from them: storing it would cost the same write in the forward and read here),
dX' and dh; write dX and dy; that is (3n + 2)C x-sized elements plus C of dh's dtype, plus
the per-token coefficients and their gradients (3(n^2 + 2n)) and dproj, dsumsq (K + 1),
f32. phi, g, dphi and dg are moved once per call. The sum over C in dm needs all of m
before any G_i: the kernels make two passes over C tiles of a token block, the first
computing X' and m (the TPU kernel keeps both in VMEM scratch, so HBM is read once), the
second the gradients; the coefficient gradients and dphi, dg accumulate across tiles and
token blocks without any [tokens, nC, K] intermediate.

"tpu" (Mosaic): grid (token blocks,), sequential ("arbitrary") so that dphi [n, K, C]
  (K on sublanes) and dg [1, C] stay resident accumulators; X, dX' and dX in blocks of
  whole token rows, the C tiles static lane slices of width tc inside the kernel. Every
  block is moved once: the traffic by block specs is the bound. Where C is a multiple of
  128 the streams come as [N, n*C] rows (``BackwardPlan.flat_streams``), the layout the
  forward kernel reads and writes for that C: a [N, n, C] array is tiled on TPU over its
  two minor dims (n, C), so every change between the two forms is a relayout copy of the
  streams, and a step whose kernels disagree pays two or more such copies (2 n C read and
  written each) per sub-layer, more than the kernels' own traffic. Elsewhere [N, n, C].
"gpu" (Triton): grid (token blocks,), parallel; the second pass re-reads the X, y and dh
  tiles (the first pass's re-read in L2, as the forward's phase 2) and dphi, dg are
  accumulated with atomic adds into zeroed outputs (nC K + C f32 per token block).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from v41jax.kernels.mhc_single_pass.plan import (
    GPU_NUM_WARPS,
    TPU_VMEM_BUDGET,
    TPU_VMEM_HARD_LIMIT,
    TPU_VMEM_HEADROOM,
    Block,
    block_traffic,
    item,
)

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
GPU_BWD_BLOCK_TOKENS = 128
GPU_BWD_TILE_ELEMS = 2048  # bt x tc f32 elements per live tile (n + 2 tiles live per stream)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """Static choices of one backward call (hashable)."""

    target: str  # "tpu" | "gpu"
    norm_eps: float
    block_tokens: int
    block_c: int  # the C tile of the in-kernel loops
    k_pad: int | None  # phi's K padded (TPU: to 8 sublanes; GPU: a power of two >= 16)
    interpret: bool
    vmem_limit_bytes: int | None = None

    @property
    def flat_streams(self) -> bool:
        """X, dX' and dX as [N, n*C] (TPU, C tiles of whole 128-lane multiples: the
        forward kernel's layout, see the module docstring); else [N, n, C]."""
        return self.target == "tpu" and self.block_c % 128 == 0


def tpu_backward_vmem_bytes(bt, n, c, kp, x_item, h_item, with_norm, with_stats,
                            flat=False) -> int:  # fmt: skip
    """VMEM of the TPU backward: double-buffered blocks of X, dX' and dX ([bt, n C] rows when
    `flat`, else [bt, n, C] with n padded to the 8 x packing sublane tile), [bt, C] blocks
    of y, dh, dy, the X' and m scratch (f32), and phi / dphi [n, K, C] and dg when present."""
    lanes = -(-c // 128) * 128
    sub = lambda rows, it: -(-rows // (8 * max(1, 4 // it))) * 8 * max(1, 4 // it)
    if flat:
        streams = sub(bt, x_item) * n * lanes * x_item
    else:
        streams = bt * sub(n, x_item) * lanes * x_item
    rows = lambda it: sub(bt, it) * lanes * it
    total = 2 * (3 * streams + 2 * rows(x_item) + rows(h_item))
    total += (n + 1) * sub(bt, 4) * lanes * 4  # X' and m scratch
    total += 2 * 3 * sub(bt, 4) * 128 * 4 * 2  # coefficients and their gradients
    if with_norm:
        total += 4 * 8 * lanes * 4
    if with_stats:
        total += 4 * n * sub(kp, 4) * lanes * 4 + 2 * 2 * sub(bt, 4) * 128 * 4
    return total


def make_backward_plan(
    target: str, *, num, n, c, k, x_item, h_item, with_norm, norm_eps, block_tokens=None,
    block_c=None, interpret=False,
) -> BackwardPlan:  # fmt: skip
    """The backward kernel's tiling for N=num tokens, or a ValueError naming the limit."""
    with_stats = k is not None

    def fail(msg: str):
        raise ValueError(f"mhc_single_pass backward ({target} kernel): {msg}")

    if target == "tpu":
        kp = None if k is None else -(-k // 8) * 8
        tcs = [t for t in (512, 256, 128) if c % t == 0] or [c]
        if block_c is not None:
            if c % block_c or (block_c != c and block_c % 128):
                fail(f"block_c={block_c} must divide C={c} and be a multiple of 128 or C")
            tcs = [block_c]
        cap = -(-num // 8) * 8
        bts = [block_tokens] if block_tokens else [256, 128, 64, 32, 16, 8]
        if block_tokens is not None and block_tokens % 8 and block_tokens < num:
            fail(f"block_tokens={block_tokens} must be a multiple of 8 (TPU sublanes)")
        bts = [min(b, cap) for b in bts]
        need = lambda b: tpu_backward_vmem_bytes(
            b, n, c, kp or 0, x_item, h_item, with_norm, with_stats, tcs[0] % 128 == 0
        )
        fits = [b for b in bts if need(b) <= TPU_VMEM_BUDGET] or [bts[-1]]
        bt = fits[0]
        if need(bt) > TPU_VMEM_HARD_LIMIT:
            fail(f"VMEM need {need(bt)} bytes at block_tokens={bt} exceeds "
                 f"{TPU_VMEM_HARD_LIMIT} (n={n}, C={c}, K={k})")  # fmt: skip
        vmem = min(need(bt) + TPU_VMEM_HEADROOM, TPU_VMEM_HARD_LIMIT)
        return BackwardPlan("tpu", norm_eps, bt, tcs[0], kp, interpret, vmem)
    if target != "gpu":
        raise ValueError(f"mhc_single_pass backward: target must be tpu or gpu, got {target!r}")
    # 128 tokens a program: the atomic adds of dphi (n C Kp f32 per program) cost
    # n C Kp 4 / 128 bytes per token (``backward_traffic``: 1.13x the bound in bf16 at
    # n = 4), against fewer programs in flight (64 at 8,192 tokens a GPU).
    bt = block_tokens or GPU_BWD_BLOCK_TOKENS
    if bt & (bt - 1) or bt < 16:
        fail(f"block_tokens={bt} must be a power of two >= 16 (Triton dot operands)")
    tcs = [block_c] if block_c else [t for t in (128, 64, 32, 16) if c % t == 0]
    tcs = [t for t in tcs if bt * t <= GPU_BWD_TILE_ELEMS] or tcs[-1:]
    if not tcs or tcs[0] & (tcs[0] - 1) or c % tcs[0] or tcs[0] < 16:
        fail(f"C={c} needs a power-of-two tile >= 16 dividing it (block_c={block_c})")
    kp = None if k is None else max(16, 1 << (k - 1).bit_length())
    return BackwardPlan("gpu", norm_eps, bt, tcs[0], kp, interpret)


def backward_bound_bytes(n, c, k, x_item, h_item, with_norm) -> int:
    """Bytes per token that any backward must move (module docstring): X, y, dX' read and
    dX, dy written in X's dtype, dh read in h's, the n^2 + 2n coefficients read and their
    gradients written (f32), dproj and dsumsq read (f32) when there are statistics."""
    k = 0 if k is None else k
    per = (3 * n + 2) * c * x_item + c * h_item + 2 * (n * n + 2 * n) * 4
    return per + ((k + 1) * 4 if k else 0)


def backward_block_specs(plan: BackwardPlan, num, n, c, x_dtype, h_dtype, with_norm, with_stats):
    """``(grid, in_blocks, out_blocks)`` of the backward kernel, operands in kernel order:
    ins (x, y, h_res, h_post, a_pre[, g][, phi], dx', dh[, dproj, dsumsq]), outs (dx, dy,
    dh_res, dh_post, da_pre[, dg][, dphi])."""
    bt, xi, hi = plan.block_tokens, item(x_dtype), item(h_dtype)
    grid = (-(-num // bt),)
    kp = plan.k_pad

    def tok(*tail, it):  # a token block of rows [bt, *tail]
        rest = (0,) * len(tail)
        return ((bt, *tail), lambda t: (t, *rest), it)

    def whole(*shape):  # the whole array, f32, the same block at every step
        zeros = (0,) * len(shape)
        return (shape, lambda t: zeros, 4)

    phi_shape = (n, kp, c)
    streams = (n * c,) if plan.flat_streams else (n, c)
    ins = [tok(*streams, it=xi), tok(c, it=xi), tok(n * n, it=4), tok(n, it=4), tok(n, it=4)]
    ins += [whole(1, c)] if with_norm else []
    ins += [whole(*phi_shape)] if with_stats else []
    ins += [tok(*streams, it=xi), tok(c, it=hi)]
    ins += [tok(kp, it=4), tok(1, it=4)] if with_stats else []
    outs: list[Block] = [tok(*streams, it=xi), tok(c, it=xi), tok(n * n, it=4), tok(n, it=4)]
    outs += [tok(n, it=4)]
    outs += [whole(1, c)] if with_norm else []
    outs += [whole(*phi_shape)] if with_stats else []
    return grid, ins, outs


def backward_traffic(plan: BackwardPlan, num, n, c, x_dtype, h_dtype, with_norm, with_stats):
    """Bytes the backward kernel moves: its block specs' traffic (``block_traffic``), plus,
    for the GPU kernel, one 4-byte atomic add per element of dphi and dg per program (a
    reduction Triton sends to L2; counted as HBM traffic here, an upper bound)."""
    grid, ins, outs = backward_block_specs(plan, num, n, c, x_dtype, h_dtype, with_norm,
                                           with_stats)  # fmt: skip
    total = block_traffic(grid, ins + outs)
    if plan.target == "gpu":
        per_program = (n * plan.k_pad * c if with_stats else 0) + (c if with_norm else 0)
        total += (grid[0] - 1) * per_program * 4  # the first program's adds are the write
    return total


def _lane_pack(cols: list, width: int):
    """[bt, width] from `width` [bt, 1] columns (a lane mask per column: Mosaic has no
    lane concatenation of single columns)."""
    lane = lax.broadcasted_iota(jnp.int32, (cols[0].shape[0], width), 1)
    out = jnp.zeros((cols[0].shape[0], width), _F32)
    for k, v in enumerate(cols):
        out = jnp.where(lane == k, v, out)
    return out


def _static_tiles(nct, tc):
    """The TPU kernel's C loop: unrolled over static lane slices (Mosaic's simplest form)."""

    def loop(body, carry):
        for t in range(nct):
            carry = body(slice(t * tc, (t + 1) * tc), carry)
        return carry

    return loop


def _fori_tiles(nct, tc):
    """The GPU kernel's C loop: a ``fori_loop`` over dynamic slices (an unrolled loop at
    C = 7168 makes a Triton program too large to compile in reasonable time)."""

    def loop(body, carry):
        step = lambda t, cr: body(pl.ds(pl.multiple_of(t * tc, tc), tc), cr)
        return lax.fori_loop(0, nct, step, carry)

    return loop


def _backward_body(ld, st, *, n, c, bt, with_norm, with_stats, eps, x_dtype, cols, acc, tiles):
    """The two passes over C tiles shared by both variants. ``ld(name, i, sl)`` loads a tile
    (f32), ``st(name, i, sl, v)`` stores one, ``cols`` are the per-token coefficient columns
    [bt, 1]; ``acc(name, i, sl, v)`` accumulates a token-reduced tile (dphi_i, dg);
    ``tiles(body, carry)`` runs ``body(slice, carry)`` over the C tiles."""
    bsum = lambda v: jnp.sum(v, axis=-1, keepdims=True)
    zero = jnp.zeros((bt, 1), _F32)

    def pass1(sl, carry):  # X' and m, the sums the norm's gradient needs
        msq, mgg = carry
        y = ld("y", 0, sl)
        xs = [ld("x", j, sl) for j in range(n)]
        m = None
        for i in range(n):
            xi = cols["post"][i] * y
            for j in range(n):
                xi = xi + cols["res"][i * n + j] * xs[j]
            xi = xi.astype(x_dtype).astype(_F32)  # the stored (rounded) stream
            st("xn", i, sl, xi)
            m = cols["pre"][i] * xi if m is None else m + cols["pre"][i] * xi
        st("m", 0, sl, m)
        if with_norm:
            msq = msq + bsum(m * m)
            mgg = mgg + bsum(m * ld("dh", 0, sl) * ld("g", 0, sl))
        return msq, mgg

    msq, mgg = tiles(pass1, (zero, zero))
    s = lax.rsqrt(msq / c + eps) if with_norm else None

    def pass2(sl, carry):  # the gradients
        d_res, d_post, d_pre = (list(v) for v in carry)
        y, dh, m = ld("y", 0, sl), ld("dh", 0, sl), ld("m", 0, sl)
        if with_norm:
            g = ld("g", 0, sl)
            dm = s * dh * g - (s * s * s / c) * mgg * m
            acc("dg", 0, sl, dh * m * s)  # [bt, tc]: the accumulator sums the tokens
        else:
            dm = dh
        xs = [ld("x", j, sl) for j in range(n)]
        dx = [None] * n
        dy = None
        for i in range(n):
            xn = ld("xn", i, sl)
            gi = ld("dxn", i, sl) + cols["pre"][i] * dm
            if with_stats:
                gi = gi + ld("dproj_phi", i, sl) + 2.0 * ld("dsumsq", 0, sl) * xn
                acc("dphi", i, sl, xn)
            d_pre[i] = d_pre[i] + bsum(dm * xn)
            d_post[i] = d_post[i] + bsum(gi * y)
            for j in range(n):
                d_res[i * n + j] = d_res[i * n + j] + bsum(gi * xs[j])
                term = cols["res"][i * n + j] * gi
                dx[j] = term if dx[j] is None else dx[j] + term
            dy = cols["post"][i] * gi if dy is None else dy + cols["post"][i] * gi
        for j in range(n):
            st("dx", j, sl, dx[j])
        st("dy", 0, sl, dy)
        return tuple(d_res), tuple(d_post), tuple(d_pre)

    carry = ((zero,) * (n * n), (zero,) * n, (zero,) * n)
    return tiles(pass2, carry)


_REF_NAMES = (
    # ins: (name, present when)
    ("x", None), ("y", None), ("h_res", None), ("h_post", None), ("a_pre", None),
    ("g", "norm"), ("phi", "stats"), ("dxn", None), ("dh", None),
    ("dproj", "stats"), ("dsumsq", "stats"),
    # outs
    ("dx", None), ("dy", None), ("dh_res", None), ("dh_post", None), ("da_pre", None),
    ("dg", "norm"), ("dphi", "stats"),
)  # fmt: skip


def _named_refs(refs, with_norm: bool, with_stats: bool) -> tuple[dict, list]:
    """The kernel's refs by name in the operand order of ``backward_block_specs`` (absent
    optional operands are None), and the refs after them (the TPU kernel's scratch)."""
    present = {None: True, "norm": with_norm, "stats": with_stats}
    it = iter(refs)
    named = {name: next(it) if present[when] else None for name, when in _REF_NAMES}
    return named, list(it)


def _tpu_backward_kernel(*refs, n, c, tc, with_norm, with_stats, eps, num, flat):
    """The grid's last block may hang past N: its rows are masked out of dg and dphi (their
    dX, dy and coefficient rows are dropped by the pipeline). `flat`: the streams' blocks
    are [bt, n C] rows (stream i's tile at lanes i C + the tile's), else [bt, n, C]."""
    r, (xn_ref, m_ref) = _named_refs(refs, with_norm, with_stats)
    x_ref, y_ref, g_ref, phi_ref, dxn_ref, dh_ref = (
        r[k] for k in ("x", "y", "g", "phi", "dxn", "dh")
    )
    dx_ref, dy_ref, dg_ref, dphi_ref = r["dx"], r["dy"], r["dg"], r["dphi"]
    bt = y_ref.shape[0]

    @pl.when(pl.program_id(0) == 0)
    def _zero():
        if with_norm:
            dg_ref[...] = jnp.zeros_like(dg_ref)
        if with_stats:
            dphi_ref[...] = jnp.zeros_like(dphi_ref)

    col = lambda ref, k: ref[:, k : k + 1].astype(_F32)
    cols = {
        "res": [col(r["h_res"], k) for k in range(n * n)],
        "post": [col(r["h_post"], k) for k in range(n)],
        "pre": [col(r["a_pre"], k) for k in range(n)],
    }
    rows = pl.program_id(0) * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    valid = rows < num
    dproj = jnp.where(valid, r["dproj"][...].astype(_F32), 0.0) if with_stats else None
    dss = r["dsumsq"][...].astype(_F32) if with_stats else None

    def stream(i, sl):  # stream i's tile sl: lanes i C + sl of a row block, or [:, i, sl]
        if flat:
            return slice(None), slice(i * c + sl.start, i * c + sl.stop)
        return slice(None), i, sl

    def ld(name, i, sl):
        if name == "x":
            return x_ref[stream(i, sl)].astype(_F32)
        if name == "dxn":
            return dxn_ref[stream(i, sl)].astype(_F32)
        if name == "xn":
            return xn_ref[i, :, sl]
        if name == "dproj_phi":  # [bt, K] @ [K, tc]
            return jnp.dot(dproj, phi_ref[i, :, sl], precision=_HI, preferred_element_type=_F32)
        if name == "dsumsq":
            return dss
        ref = {"y": y_ref, "dh": dh_ref, "m": m_ref, "g": g_ref}[name]
        return ref[:, sl].astype(_F32)

    def st(name, i, sl, v):
        if name == "xn":
            xn_ref[i, :, sl] = v
        elif name == "m":
            m_ref[:, sl] = v
        elif name == "dx":
            dx_ref[stream(i, sl)] = v.astype(dx_ref.dtype)
        else:
            dy_ref[:, sl] = v.astype(dy_ref.dtype)

    def acc(name, i, sl, v):
        v = jnp.where(valid, v, 0.0)  # rows past N hold whatever the buffer held
        if name == "dg":
            dg_ref[:, sl] += jnp.sum(v, axis=0, keepdims=True)
        else:  # dphi_i[:, tile] += dproj^T X'_i: [K, bt] x [bt, tc]
            dims = (((0,), (0,)), ((), ()))
            dphi_ref[i, :, sl] += lax.dot_general(
                dproj, v, dims, precision=_HI, preferred_element_type=_F32
            )

    d_res, d_post, d_pre = _backward_body(
        ld, st, n=n, c=c, bt=bt, with_norm=with_norm, with_stats=with_stats, eps=eps,
        x_dtype=x_ref.dtype, cols=cols, acc=acc, tiles=_static_tiles(c // tc, tc),
    )  # fmt: skip
    r["dh_res"][...] = _lane_pack(list(d_res), n * n)
    r["dh_post"][...] = _lane_pack(list(d_post), n)
    r["da_pre"][...] = _lane_pack(list(d_pre), n)


def _gpu_backward_kernel(*refs, n, c, tc, with_norm, with_stats, eps):
    """Triton: X' and m are recomputed in pass 2 from re-read tiles (no scratch)."""
    r, _ = _named_refs(refs, with_norm, with_stats)
    x_ref, y_ref, g_ref, phi_ref, dxn_ref, dh_ref = (
        r[k] for k in ("x", "y", "g", "phi", "dxn", "dh")
    )
    dx_ref, dy_ref, dg_ref, dphi_ref = r["dx"], r["dy"], r["dg"], r["dphi"]
    bt = y_ref.shape[0]
    width = {"res": n * n, "post": n, "pre": n}
    coef = {"res": r["h_res"], "post": r["h_post"], "pre": r["a_pre"]}
    cols = {m: [coef[m][:, pl.ds(k, 1)].astype(_F32) for k in range(width[m])] for m in coef}
    dproj = r["dproj"][...].astype(_F32) if with_stats else None
    dss = r["dsumsq"][...].astype(_F32) if with_stats else None
    cache = {}  # pass 1's X' and m tiles, recomputed once per tile of pass 2

    def recompute(sl):
        key = id(sl)  # one slice object per traced tile
        if key not in cache:
            y = y_ref[:, sl].astype(_F32)
            xs = [x_ref[:, j, sl].astype(_F32) for j in range(n)]
            xn, m = [], None
            for i in range(n):
                xi = cols["post"][i] * y
                for j in range(n):
                    xi = xi + cols["res"][i * n + j] * xs[j]
                xi = xi.astype(x_ref.dtype).astype(_F32)
                xn.append(xi)
                m = cols["pre"][i] * xi if m is None else m + cols["pre"][i] * xi
            cache.clear()
            cache[key] = (xn, m)
        return cache[key]

    def ld(name, i, sl):
        if name == "x":
            return x_ref[:, i, sl].astype(_F32)
        if name == "dxn":
            return dxn_ref[:, i, sl].astype(_F32)
        if name == "xn":
            return recompute(sl)[0][i]
        if name == "m":
            return recompute(sl)[1]
        if name == "dproj_phi":
            return jnp.dot(dproj, phi_ref[i, :, sl].astype(_F32), precision=_HI)
        if name == "dsumsq":
            return dss
        if name == "g":
            return g_ref[:, sl].astype(_F32)
        return {"y": y_ref, "dh": dh_ref}[name][:, sl].astype(_F32)

    def st(name, i, sl, v):
        if name == "dx":
            dx_ref[:, i, sl] = v.astype(dx_ref.dtype)
        elif name == "dy":
            dy_ref[:, sl] = v.astype(dy_ref.dtype)
        # "xn", "m": recomputed instead of stored

    def acc(name, i, sl, v):
        if name == "dg":
            pltriton.atomic_add(dg_ref, (pl.ds(0, 1), sl), jnp.sum(v, axis=0, keepdims=True))
        else:
            tile = jnp.dot(dproj.T, v, precision=_HI)  # [Kp, tc]
            # a [1, Kp, tc] block: the interpreter's atomic rule takes slices, not ints
            kp = dphi_ref.shape[1]
            pltriton.atomic_add(dphi_ref, (pl.ds(i, 1), pl.ds(0, kp), sl), tile[None])

    d_res, d_post, d_pre = _backward_body(
        ld, st, n=n, c=c, bt=bt, with_norm=with_norm, with_stats=with_stats, eps=eps,
        x_dtype=x_ref.dtype, cols=cols, acc=acc, tiles=_fori_tiles(c // tc, tc),
    )  # fmt: skip
    for ref, vals in ((r["dh_res"], d_res), (r["dh_post"], d_post), (r["da_pre"], d_pre)):
        for k, v in enumerate(vals):
            ref[:, pl.ds(k, 1)] = v


def single_pass_backward_pallas(
    plan: BackwardPlan,
    x_NxnxC, y_NxC, h_res_Nxnn, h_post_Nxn, a_pre_Nxn, norm_scale_1xC, phi_nxKxC,
    dxn_NxnxC, dh_NxC, dproj_NxK, dsumsq_Nx1,
) -> tuple[Any, ...]:  # fmt: skip
    """``(dx, dy, dh_res [N, n*n], dh_post, da_pre, dg [1, C] | None, dphi [n, Kp, C] | None)``.

    x, dx' and dx are [N, n, C], or [N, n*C] where ``plan.flat_streams`` (then pass n).
    phi comes as [n, Kp, C] (K padded with zeros to ``plan.k_pad``) and dproj as [N, Kp];
    the GPU plan needs N % block_tokens == 0 (the caller pads with zero cotangents)."""
    num, c = y_NxC.shape
    n = x_NxnxC.shape[1] // c if plan.flat_streams else x_NxnxC.shape[1]
    with_norm, with_stats = norm_scale_1xC is not None, phi_nxKxC is not None
    grid, ins, outs = backward_block_specs(
        plan, num, n, c, x_NxnxC.dtype, dh_NxC.dtype, with_norm, with_stats
    )
    common = dict(n=n, c=c, tc=plan.block_c, with_norm=with_norm, with_stats=with_stats,
                  eps=plan.norm_eps)  # fmt: skip
    operands = [x_NxnxC, y_NxC, h_res_Nxnn, h_post_Nxn, a_pre_Nxn]
    operands += [norm_scale_1xC] if with_norm else []
    operands += [phi_nxKxC] if with_stats else []
    operands += [dxn_NxnxC, dh_NxC]
    operands += [dproj_NxK, dsumsq_Nx1] if with_stats else []
    out_shape = [
        jax.ShapeDtypeStruct(x_NxnxC.shape, x_NxnxC.dtype),
        jax.ShapeDtypeStruct((num, c), y_NxC.dtype),
        jax.ShapeDtypeStruct((num, n * n), _F32),
        jax.ShapeDtypeStruct((num, n), _F32),
        jax.ShapeDtypeStruct((num, n), _F32),
    ]
    out_shape += [jax.ShapeDtypeStruct((1, c), _F32)] if with_norm else []
    out_shape += [jax.ShapeDtypeStruct(phi_nxKxC.shape, _F32)] if with_stats else []
    bt = plan.block_tokens
    spec = lambda b: pl.BlockSpec(b[0], b[1])
    flops = num * (2 * n * n * c * 3 + 12 * n * c)
    flops += 4 * num * n * c * plan.k_pad if with_stats else 0
    cost = pl.CostEstimate(
        flops=int(flops), transcendentals=int(num if with_norm else 0),
        bytes_accessed=int(block_traffic(grid, ins + outs)),
    )  # fmt: skip
    if plan.target == "tpu":
        kernel = functools.partial(_tpu_backward_kernel, **common, num=num,
                                   flat=plan.flat_streams)  # fmt: skip
        scratch = [pltpu.VMEM((n, bt, c), _F32), pltpu.VMEM((bt, c), _F32)]
        params = pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=plan.vmem_limit_bytes
        )
        return tuple(
            pl.pallas_call(
                kernel, grid=grid, in_specs=[spec(b) for b in ins],
                out_specs=[spec(b) for b in outs], out_shape=out_shape, scratch_shapes=scratch,
                compiler_params=params, cost_estimate=cost, interpret=plan.interpret,
            )(*operands)
        )  # fmt: skip
    # GPU: dg and dphi are atomically accumulated into zeroed buffers passed in and aliased.
    kernel = functools.partial(_gpu_backward_kernel, **common)
    n_in = len(operands)
    zeros = [jnp.zeros(s.shape, s.dtype) for s in out_shape[5:]]
    aliases = {n_in + k: 5 + k for k in range(len(zeros))}

    def with_zero_inputs(*refs):
        # the aliased zero inputs are the same buffers as the outputs: drop the input refs
        return kernel(*refs[:n_in], *refs[n_in + len(zeros) :])

    in_specs = [spec(b) for b in ins] + [spec(b) for b in outs[5:]]
    return tuple(
        pl.pallas_call(
            with_zero_inputs, grid=grid, in_specs=in_specs,
            out_specs=[spec(b) for b in outs], out_shape=out_shape,
            input_output_aliases=aliases,
            compiler_params=pltriton.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=1),
            cost_estimate=cost, interpret=plan.interpret,
        )(*operands, *zeros)
    )  # fmt: skip
