"""Pallas kernels of one Single-Pass mHC step, tiled over tokens and over C.

Per token (equations in ``reference.py``): X_{l+1} = B X_l + c^T y, h_{l+1} = RMSNorm(a
X_{l+1}) g, and optionally proj = vec(X_{l+1}) phi, sumsq = sum X_{l+1}^2. Everything but
the RMS scale of h_{l+1} is a sum over C tiles, so each C tile of X_l [bt, n, tc] and y
[bt, tc] is read once, its X_{l+1} tile written once, and proj, sumsq and sum (a X)^2 are
accumulated per tile; the RMS scale is applied after the last tile ("normalise after", as
the coefficient path divides v phi by r after projecting). The ideal traffic of one step
is (n+1)C read + (n+1)C written per token, plus the n^2 + 2n coefficients and K + 1
statistics; phi [n, C, K] has a constant index map and is moved once per call.

Two variants (``Plan.target``):

"tpu" (Mosaic TPU), for C tiles of whole 128-lane multiples: grid (token blocks
  "parallel", C tiles "arbitrary", streams "arbitrary"). X is viewed as [N, n*C] and passed
  once per stream, so stream j's tile is a dense [bt, tc] block (column j*C/tc + ci) that
  stays put while the inner stream axis i moves: every X_l tile is fetched once, and step
  i writes the [bt, tc] tile of stream i of X_{l+1} (no strided or padded n-row access:
  a [bt, n, tc] block would pad n=4 rows to the 8/16-row tile). The coefficient column of
  the dynamic i is picked by a lane mask. The h_{l+1} output block [bt, C] stays resident
  across both inner axes: a sum (a X_{l+1}) accumulates per C tile in an f32 VMEM scratch,
  and the last step normalises all of it and writes h once. proj and sumsq blocks are
  resident accumulators too. phi is passed as [n, C/tc, K, tc] (K on sublanes: a [C, K]
  layout would pad K=24 to 128 lanes) and fetched once. VMEM is sized by
  ``plan.tpu_vmem_bytes`` and requested with ``vmem_limit_bytes``.
  C not a multiple of 128 (C = 1000, small models, tests) takes one tile of the whole C
  (grid: token blocks): X in [bt, n, C] blocks of its own [N, n, C] array, stream j being
  ``x_ref[:, j, :]`` (an [N*n, C] view read as strided rows j, j+n, ... would need Mosaic's
  strided loads, which take only 32-bit data in 128-lane rows; compiled for v5e, C = 1000
  was refused in bf16 and f32). Same traffic: each X, y element read once, X_{l+1} and h
  written once.

"gpu" (Triton, chosen explicitly with ``pltriton.CompilerParams``): JAX 0.10.2 lowers
  ``pallas_call`` on CUDA to Mosaic GPU by default (``jax_pallas_use_mosaic_gpu``; that
  path is deprecated for ``pallas_call`` in favour of ``plgpu.kernel``). Mosaic GPU stages
  every block, phi included, in shared memory (what overflowed 227 KiB: 863,240 bytes at
  C = 1024), and a C-tiled Mosaic GPU form would need its own pipeline (``plgpu.kernel``,
  TMA, Hopper-only). Triton reads blocks straight from global memory into registers, runs
  on any CUDA GPU, and this memory-bound pass needs no tensor-core pipeline: the grid is
  over token blocks and the kernel loops over C tiles in two phases. Phase 1 writes the
  X_{l+1} tiles and the unnormalised h tiles and accumulates the sums; after a barrier (a
  thread may read h elements another thread stored), phase 2 re-reads the h tiles and
  rescales them. The block-spec traffic is the ideal one; phase 2 adds 2C x out-size bytes
  per token of re-read (L2-resident: bt x C x out-size per program, 224 KiB at bt = 16,
  C = 7168, bf16), and in a narrow out dtype h is rounded twice (the unnormalised tile,
  then the result: at most one extra ulp). Token blocks and C tiles are powers of two
  (Triton tensor sizes); phi's K is padded to a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from v41jax.kernels.mhc_single_pass.plan import (
    GPU_NUM_STAGES,
    GPU_NUM_WARPS,
    Block,
    Plan,
    block_traffic,
    item,
)

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def _accumulate_tile(y, xs, col, store_x, phi_tile, with_stats):
    """The per-tile arithmetic shared by both variants (fp32): returns the tile of a X_{l+1},
    its sum of squares per token, and the tile's proj and sumsq contributions. ``col(name,
    k)`` gives coefficient column k [bt, 1]; ``store_x(i, v)`` stores stream i of X_{l+1}."""
    n = len(xs)
    mixed = proj = sumsq = None
    add = lambda acc, v: v if acc is None else acc + v
    for i in range(n):
        xi = col("post", i) * y
        for j in range(n):
            xi = xi + col("res", i * n + j) * xs[j]
        # The statistics and h use the stored (rounded) stream: they then equal what a later
        # pass would compute from X_{l+1} itself.
        xi = store_x(i, xi).astype(_F32)
        mixed = add(mixed, col("pre", i) * xi)
        if with_stats:
            proj = add(proj, phi_tile(i, xi))
            sumsq = add(sumsq, jnp.sum(xi * xi, axis=-1, keepdims=True))
    return mixed, jnp.sum(mixed * mixed, axis=-1, keepdims=True), proj, sumsq


def _tpu_whole_c_kernel(*refs, n, with_norm, with_stats, eps, c_total):
    """Grid (token block t,): the form for C not a multiple of 128, one tile of all of C.

    X comes as its own [N, n, C] array in [bt, n, C] blocks (their last two dims are the
    array's, as Mosaic requires of dims that are not (8, 128) multiples) and stream j is
    ``x_ref[:, j, :]``. Strided rows of an [N*n, C] view would need Mosaic's strided loads,
    which take only 32-bit data in 128-lane rows (C = 1000 in bf16 or f32 does not compile).
    """
    x_ref, y_ref, hres_ref, hpost_ref, apre_ref, *rest = refs
    g_ref = rest.pop(0) if with_norm else None
    phi_ref = rest.pop(0) if with_stats else None
    xo_ref, h_ref, *rest = rest
    coef = {"res": hres_ref, "post": hpost_ref, "pre": apre_ref}
    col = lambda name, k: coef[name][:, k : k + 1].astype(_F32)

    def store_x(i, v):
        v = v.astype(xo_ref.dtype)
        xo_ref[:, i, :] = v
        return v

    def phi_tile(i, xi):  # [bt, C] x [K, C]^T
        dims = (((1,), (1,)), ((), ()))
        return lax.dot_general(xi, phi_ref[i, 0], dims, precision=_HI, preferred_element_type=_F32)

    xs = [x_ref[:, j, :].astype(_F32) for j in range(n)]
    mixed, msq, proj, sumsq = _accumulate_tile(
        y_ref[...].astype(_F32), xs, col, store_x, phi_tile, with_stats
    )
    if with_stats:
        rest[0][...] = proj
        rest[1][...] = sumsq
    if with_norm:
        mixed = mixed * lax.rsqrt(msq / c_total + eps) * g_ref[...].astype(_F32)
    h_ref[...] = mixed.astype(h_ref.dtype)


def _tpu_kernel(*refs, n, nct, with_norm, with_stats, eps, c_total):
    """Grid (token block t, C tile ci, stream i): one [bt, tc] tile of stream i per step."""
    xs_refs, (y_ref, hres_ref, hpost_ref, apre_ref, *rest) = refs[:n], refs[n:]
    g_ref = rest.pop(0) if with_norm else None
    phi_ref = rest.pop(0) if with_stats else None
    xo_ref, h_ref, *rest = rest
    proj_ref, ss_ref = (rest.pop(0), rest.pop(0)) if with_stats else (None, None)
    mix_ref, msq_ref = rest
    ci, i = pl.program_id(1), pl.program_id(2)

    @pl.when((ci == 0) & (i == 0))
    def _init():
        msq_ref[...] = jnp.zeros_like(msq_ref)
        if with_stats:
            proj_ref[...] = jnp.zeros_like(proj_ref)
            ss_ref[...] = jnp.zeros_like(ss_ref)

    def col(ref, k):  # column k (dynamic) of a [bt, w] coefficient block, as [bt, 1]
        v = ref[...].astype(_F32)
        lane = lax.broadcasted_iota(jnp.int32, v.shape, 1)
        return jnp.sum(jnp.where(lane == k, v, 0.0), axis=1, keepdims=True)

    xi = col(hpost_ref, i) * y_ref[...].astype(_F32)
    for j in range(n):
        xi = xi + col(hres_ref, i * n + j) * xs_refs[j][...].astype(_F32)
    xi = xi.astype(xo_ref.dtype)
    xo_ref[...] = xi
    xi = xi.astype(_F32)  # statistics and h use the stored (rounded) stream
    term = col(apre_ref, i) * xi
    mix_ref[ci] = jnp.where(i == 0, 0.0, mix_ref[ci]) + term  # streams summed in order
    if with_stats:
        dims = (((1,), (1,)), ((), ()))
        phi = phi_ref[i, ci]  # [K, tc]
        proj_ref[...] += lax.dot_general(xi, phi, dims, precision=_HI, preferred_element_type=_F32)
        ss_ref[...] += jnp.sum(xi * xi, axis=-1, keepdims=True)

    @pl.when(i == n - 1)
    def _tile_done():
        m = mix_ref[ci]
        msq_ref[...] += jnp.sum(m * m, axis=-1, keepdims=True)

    @pl.when((ci == nct - 1) & (i == n - 1))
    def _normalise():
        inv = lax.rsqrt(msq_ref[...] / c_total + eps) if with_norm else None
        tc = mix_ref.shape[-1]
        for t in range(nct):  # static slices of the resident [bt, C] block
            sl = slice(t * tc, (t + 1) * tc)
            h = mix_ref[t]
            if with_norm:
                h = h * inv * g_ref[:, sl].astype(_F32)
            h_ref[:, sl] = h.astype(h_ref.dtype)


def _gpu_kernel(*refs, n, nct, tc, with_norm, with_stats, eps, c_total, barrier):
    x_ref, y_ref, hres_ref, hpost_ref, apre_ref, *rest = refs
    g_ref = rest.pop(0) if with_norm else None
    phi_ref = rest.pop(0) if with_stats else None
    xo_ref, h_ref, *stat_refs = rest
    bt = y_ref.shape[0]
    coef = {"res": hres_ref, "post": hpost_ref, "pre": apre_ref}
    # Column loads from the refs ([bt, 1]): Triton has no slicing of loaded tensors.
    width = {"res": n * n, "post": n, "pre": n}
    cols = {(m, k): coef[m][:, pl.ds(k, 1)].astype(_F32) for m in coef for k in range(width[m])}

    def phase1(t, carry):
        msq_acc, proj_acc, ss_acc = carry
        sl = pl.ds(pl.multiple_of(t * tc, tc), tc)

        def store_x(i, v):
            v = v.astype(xo_ref.dtype)
            xo_ref[:, i, sl] = v
            return v

        def phi_tile(i, xi):
            return jnp.dot(xi, phi_ref[i, sl, :].astype(_F32), precision=_HI)

        xs = [x_ref[:, j, sl].astype(_F32) for j in range(n)]
        mixed, msq, proj, sumsq = _accumulate_tile(
            y_ref[:, sl].astype(_F32), xs, lambda m, k: cols[m, k], store_x, phi_tile, with_stats
        )
        h_ref[:, sl] = mixed.astype(h_ref.dtype)
        if with_stats:
            proj_acc, ss_acc = proj_acc + proj, ss_acc + sumsq
        return msq_acc + msq, proj_acc, ss_acc

    kp = phi_ref.shape[-1] if with_stats else 1
    zeros = lambda *s: jnp.zeros(s, _F32)
    msq, proj, sumsq = lax.fori_loop(0, nct, phase1, (zeros(bt, 1), zeros(bt, kp), zeros(bt, 1)))
    if with_stats:
        stat_refs[0][...] = proj
        stat_refs[1][...] = sumsq
    if not with_norm:
        return
    inv = lax.rsqrt(msq / c_total + eps)
    if barrier:  # phase 2 may read h elements another thread of the program stored
        pltriton.debug_barrier()

    def phase2(t, _):
        sl = pl.ds(pl.multiple_of(t * tc, tc), tc)
        h = h_ref[:, sl].astype(_F32) * inv * g_ref[:, sl].astype(_F32)
        h_ref[:, sl] = h.astype(h_ref.dtype)
        return 0

    lax.fori_loop(0, nct, phase2, 0)


def tpu_dense(plan: Plan) -> bool:
    """The TPU kernel's stream-major form: C tiles of whole 128-lane multiples."""
    return plan.target == "tpu" and plan.block_c % 128 == 0


def block_specs(plan: Plan, num: int, n: int, c: int, k: int | None, x_dtype, with_norm: bool):
    """``(grid, in_blocks, out_blocks)`` of the kernel: each block as (shape, index map,
    item size), the operands in kernel order (x, y, h_res, h_post, a_pre[, g][, phi])."""
    bt, tc = plan.block_tokens, plan.block_c
    xi, oi = item(x_dtype), item(plan.out_dtype)
    with_stats = k is not None
    if tpu_dense(plan):
        nct = c // tc
        grid = (-(-num // bt), nct, n)
        tok = lambda w, it: ((bt, w), lambda t, ci, i: (t, 0), it)
        ins = [((bt, tc), lambda t, ci, i, j=j: (t, j * nct + ci), xi) for j in range(n)]
        ins += [((bt, tc), lambda t, ci, i: (t, ci), xi), tok(n * n, 4), tok(n, 4), tok(n, 4)]
        if with_norm:
            ins.append(((1, c), lambda t, ci, i: (0, 0), 4))
        if with_stats:
            ins.append(((n, nct, k, tc), lambda t, ci, i: (0, 0, 0, 0), 4))
        outs = [((bt, tc), lambda t, ci, i: (t, i * nct + ci), xi), tok(c, oi)]
        if with_stats:
            outs += [tok(k, 4), tok(1, 4)]
        return grid, ins, outs
    if plan.target == "tpu":  # one tile of all of C (see _tpu_whole_c_kernel)
        grid = (-(-num // bt),)
        tok = lambda w, it: ((bt, w), lambda t: (t, 0), it)
        ins = [((bt, n, c), lambda t: (t, 0, 0), xi), tok(c, xi)]
        ins += [tok(n * n, 4), tok(n, 4), tok(n, 4)]
        if with_norm:
            ins.append(((1, c), lambda t: (0, 0), 4))
        if with_stats:
            ins.append(((n, 1, k, c), lambda t: (0, 0, 0, 0), 4))
        outs = [((bt, n, c), lambda t: (t, 0, 0), xi), tok(c, oi)]
        if with_stats:
            outs += [tok(k, 4), tok(1, 4)]
        return grid, ins, outs
    grid = (-(-num // bt),)
    tok = lambda *tail, it: ((bt, *tail), lambda t: (t,) + (0,) * len(tail), it)
    ins = [tok(n, c, it=xi), tok(c, it=xi), tok(n * n, it=4), tok(n, it=4), tok(n, it=4)]
    if with_norm:
        ins.append(((1, c), lambda t: (0, 0), 4))
    if with_stats:
        ins.append(((n, c, plan.pad_k_to), lambda t: (0, 0, 0), 4))
    outs = [tok(n, c, it=xi), tok(c, it=oi)]
    if with_stats:
        outs += [tok(plan.pad_k_to, it=4), tok(1, it=4)]
    return grid, ins, outs


def cost_estimate(plan, num, n, c, k, x_dtype, with_norm) -> pl.CostEstimate:
    """Flops of the update ((n+1) FMAs per stream element), the mix, the norm and the
    statistics (a [n*C, K] projection and a sum of squares); one rsqrt per token; bytes
    from the block specs."""
    grid, ins, outs = block_specs(plan, num, n, c, k, x_dtype, with_norm)
    kk = 0 if k is None else (plan.pad_k_to or k)
    flops = num * (2 * n * (n + 1) * c + 2 * n * c + (3 * c if with_norm else 0))
    flops += 0 if k is None else num * (2 * n * c * kk + 2 * n * c)
    return pl.CostEstimate(
        flops=int(flops),
        transcendentals=int(num if with_norm else 0),
        bytes_accessed=int(block_traffic(grid, ins + outs)),
    )


def _spec(block: Block) -> pl.BlockSpec:
    return pl.BlockSpec(block[0], block[1])


def single_pass_pallas(
    plan: Plan,
    x_NxnxC: jax.Array,
    y_NxC: jax.Array,
    h_res_Nxnn: jax.Array,
    h_post_Nxn: jax.Array,
    a_pre_Nxn: jax.Array,
    norm_scale_1xC: jax.Array | None,
    phi_nxCxK: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """``(x_new [N,n,C], h_next [N,C][, proj [N,K'], sumsq [N,1]])`` with the plan's kernel.

    h_res comes flattened to [N, n*n]; norm_scale as [1, C]; phi as [n, C, K] (the GPU
    plan wants K already padded to ``plan.pad_k_to``; proj then has that width). The GPU
    plan needs N % block_tokens == 0 (``api.py`` pads); the TPU grid takes a ragged tail.
    """
    num, n, c = x_NxnxC.shape
    with_norm, with_stats = norm_scale_1xC is not None, phi_nxCxK is not None
    k = phi_nxCxK.shape[-1] if with_stats else None
    grid, ins, outs = block_specs(plan, num, n, c, k, x_NxnxC.dtype, with_norm)
    nct = c // plan.block_c
    common = dict(n=n, nct=nct, with_norm=with_norm, with_stats=with_stats, eps=plan.norm_eps)
    phi_op = phi_nxCxK
    scratch = []
    x_ops = [x_NxnxC]
    if plan.target == "tpu":
        bt, tc = plan.block_tokens, plan.block_c
        if tpu_dense(plan):
            kernel = functools.partial(_tpu_kernel, **common, c_total=float(c))
            # [N, n*C]: stream j's tile ci is block column j*nct + ci; the same array is
            # passed once per stream.
            x_ops = [x_NxnxC.reshape(num, n * c)] * n
            scratch = [pltpu.VMEM((nct, bt, tc), _F32), pltpu.VMEM((bt, 1), _F32)]
        else:  # X as it is, [N, n, C]
            del common["nct"]
            kernel = functools.partial(_tpu_whole_c_kernel, **common, c_total=float(c))
        if with_stats:  # [n, C, K] -> [n, C/tc, K, tc]: K on sublanes, tiles on a leading axis
            phi_op = phi_nxCxK.reshape(n, nct, tc, k).transpose(0, 1, 3, 2)
        params = pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")[: len(grid)],
            vmem_limit_bytes=plan.vmem_limit_bytes,
        )
    else:
        kernel = functools.partial(
            _gpu_kernel,
            **common,
            tc=plan.block_c,
            c_total=float(c),
            barrier=not plan.interpret,  # the interpreter has no threads (nor a rule for it)
        )
        params = pltriton.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES)
    operands = [*x_ops, y_NxC, h_res_Nxnn, h_post_Nxn, a_pre_Nxn]
    operands += [norm_scale_1xC] if with_norm else []
    operands += [phi_op] if with_stats else []
    out_shape = [
        jax.ShapeDtypeStruct(x_ops[0].shape, x_NxnxC.dtype),
        jax.ShapeDtypeStruct((num, c), plan.out_dtype),
    ]
    if with_stats:
        out_shape += [
            jax.ShapeDtypeStruct((num, outs[2][0][1]), _F32),
            jax.ShapeDtypeStruct((num, 1), _F32),
        ]
    outs_arr = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[_spec(b) for b in ins],
        out_specs=[_spec(b) for b in outs],
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=params,
        cost_estimate=cost_estimate(plan, num, n, c, k, x_NxnxC.dtype, with_norm),
        interpret=plan.interpret,
    )(*operands)
    return (outs_arr[0].reshape(num, n, c), *outs_arr[1:])
