"""Pallas TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) behind
the layout.

The kernel is the MQA form (`make_splash_mqa_single_device`: R query heads against one
k/v head) vmapped over the G kv heads and the batch, so GQA never repeats k/v; its mask is
the static causal mask `CausalMask((T, T))` and-ed with the layout's segment ids (dynamic,
`SegmentIds`), and its gradients are the kernel's own custom VJP (separate dq and dkv
kernels: the fused backward keeps a dq partial per key block, which is not linear in T).
The kernel does not scale the logits, so q is multiplied by 1/sqrt(K) first.

Causality in the kernel is by index, so it runs only where the layout is index-causal
(`common.index_causal`, checked on device with `lax.cond`); every other layout takes the
blockwise path: KV-cache prefill and decode (T != S, kv positions = cache slots, queries
at cache_index + t) statically, anything else non-index-causal at run time.

Under a multi-device mesh (`jax.set_mesh`) the kernel runs per device inside a `shard_map`
over the batch axes (and the tensor axis for heads, when it divides the q and kv heads):
Mosaic kernels cannot be partitioned by GSPMD, and attention needs no communication when
the sequence axis is not split (the logical rules never split it).

T is padded to a block multiple inside: padded keys come after every real query, so the
causal mask hides them; padded queries get a segment id of their own and see only padded
keys (no empty rows). Blocks are multiples of 128 (TPU lanes). `interpret=True` runs the
same kernel in the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from v41jax import sharding
from v41jax.kernels.attention.blockwise import blockwise_attention
from v41jax.kernels.attention.common import AttentionLayout, index_causal, round_up

LANES = 128


def splash_block(block_size: int, t: int) -> int:
    """The kernel's query/key block for length t: `block_size` (a multiple of 128), capped
    at t rounded up to 128 so short sequences are not padded to a full block."""
    return min(block_size, round_up(max(t, 1), LANES))


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, t_pad: int, block: int, interpret: bool):
    """The splash MQA kernel for `heads` query heads per kv head over t_pad tokens (cached:
    the block mask is worked out once per shape, in numpy).

    Built in a thread of its own: JAX's trace and mesh contexts are thread-local, so there
    its mask arrays become concrete arrays on the host's default device (constants of the
    program, never a trace's tracers), even when the caller traces under a mesh of
    compile-only devices (`v41jax.kernels.aot`), where evaluating them would mean
    executing on devices that cannot run anything."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_make_kernel, heads, t_pad, block, interpret).result()


def _make_kernel(heads: int, t_pad: int, block: int, interpret: bool):
    mask = sa.MultiHeadMask([sa.CausalMask((t_pad, t_pad)) for _ in range(heads)])
    b = block
    sizes = sa.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    return sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_kernel_attention(
    q_BxTxHxK: jax.Array,
    k_BxTxGxK: jax.Array,
    v_BxTxGxK: jax.Array,
    q_segment_ids_BxT: jax.Array | None = None,
    kv_segment_ids_BxT: jax.Array | None = None,
    *,
    block_size: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """Index-causal self-attention (query t sees keys s <= t in its segment) by the splash
    kernel; [B, T, H, K]. `block_size` must be a multiple of 128."""
    b, t, h, kd = q_BxTxHxK.shape
    g = k_BxTxGxK.shape[2]
    r = h // g
    block = splash_block(block_size, t)
    t_pad = round_up(t, block)
    pad = t_pad - t
    scale = 1.0 / math.sqrt(kd)
    q = (q_BxTxHxK * scale).astype(q_BxTxHxK.dtype)
    q_BxGxRxTxK = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_BxGxRxTxK = q_BxGxRxTxK.reshape(b, t_pad, g, r, kd).transpose(0, 2, 3, 1, 4)
    k_BxGxTxK, v_BxGxTxK = (
        jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
        for x in (k_BxTxGxK, v_BxTxGxK)
    )
    kernel = _kernel(r, t_pad, block, bool(interpret))

    if q_segment_ids_BxT is None:
        # Without segments the causal mask alone hides the padded keys from real queries.
        def one_head(q_RxTxK, k_TxK, v_TxK, seg):
            return kernel(q_RxTxK, k_TxK, v_TxK)

        segs = None
    else:
        # Padded tokens get an id no real token has (max + 1): they see only each other.
        fresh = jnp.maximum(q_segment_ids_BxT.max(), kv_segment_ids_BxT.max()) + 1
        segs = tuple(
            jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad))).at[:, t:].set(fresh)
            for x in (q_segment_ids_BxT, kv_segment_ids_BxT)
        )

        def one_head(q_RxTxK, k_TxK, v_TxK, seg):
            return kernel(q_RxTxK, k_TxK, v_TxK, segment_ids=sa.SegmentIds(*seg))

    over_heads = jax.vmap(one_head, in_axes=(0, 0, 0, None))
    out = jax.vmap(over_heads, in_axes=(0, 0, 0, 0 if segs is not None else None))(
        q_BxGxRxTxK, k_BxGxTxK, v_BxGxTxK, segs
    )
    out_BxTxHxK = out.transpose(0, 3, 1, 2, 4).reshape(b, t_pad, h, kd)[:, :t]
    return out_BxTxHxK.astype(q_BxTxHxK.dtype)


def splash_attention(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    layout: AttentionLayout,
    *,
    block_size: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """The splash kernel where the layout is index-causal, else blockwise (module
    docstring); [B, T, H, K]."""
    t, s = q_BxTxHxK.shape[1], k_BxSxGxK.shape[1]
    args = (q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout)

    def fallback(q, k, v, layout):
        return blockwise_attention(q, k, v, *layout, block_size=block_size)

    if t != s or t == 0:
        return fallback(*args)

    def kernel(q, k, v, layout):
        run = functools.partial(splash_kernel_attention, block_size=block_size, interpret=interpret)
        return _per_device(run, q, k, v, layout.q_segment_ids_BxT, layout.kv_segment_ids_BxS)

    return jax.lax.cond(index_causal(layout), kernel, fallback, *args)


def _per_device(run, q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxT, kv_seg_BxS):
    """`run` on each device's rows (and heads) under an active multi-device mesh, else
    directly. Rows or heads the mesh axes do not divide are computed on every device of
    those axes (same values), never dropped."""
    mesh = jax.sharding.get_abstract_mesh()
    args = (q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxT, kv_seg_BxS)
    if mesh.empty or mesh.size == 1:
        return run(*args)
    batch = sharding.split_axes(mesh, "batch", q_BxTxHxK.shape[0])
    heads = sharding.split_axes(mesh, "act_heads", q_BxTxHxK.shape[2], k_BxSxGxK.shape[2])
    act = P(batch or None, None, heads or None, None)
    seg = None if q_seg_BxT is None else P(batch or None, None)
    smap = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(act, act, act, seg, seg),
        out_specs=act,
        check_vma=False,  # the Pallas call carries no varying-axes annotation
    )
    return smap(*args)
