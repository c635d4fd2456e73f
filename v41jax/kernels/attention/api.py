"""Entry point of causal grouped-query attention without a materialised mask.

`attend(q, k, v, layout, impl=...)`: who sees whom comes from `AttentionLayout` (positions
and segment ids), never from a [B, T, S] mask in a fast path.

Implementations (`impl`, `v41jax.config.ATTENTION_IMPLS`):
  "reference"    `reference.causal_attention` with the materialised mask (tests).
  "blockwise"    online-softmax XLA loops with a flash backward (`blockwise.py`): memory
                 linear in T, any layout, any platform.
  "dot_product"  `jax.nn.dot_product_attention`: cuDNN flash attention when lowered for
                 CUDA and cuDNN takes the inputs (`dot_product.cudnn_limits`), its XLA
                 implementation otherwise; layouts it cannot say go blockwise
                 (`dot_product.py`: packed segments, KV-cache offsets with T > 1).
  "splash"       Pallas TPU splash attention (`splash.py`), compiled when lowered for TPU and
                 in the Pallas interpreter on other platforms; KV-cache layouts go blockwise.
  "auto"         by the platform the program is LOWERED for (`lax.platform_dependent`, not
                 `jax.default_backend()` at trace time): cpu -> blockwise; cuda ->
                 dot_product with cuDNN where cuDNN takes the inputs, else blockwise;
                 tpu -> splash; any other platform -> blockwise.

Every path equals the reference on each query that sees at least one key. A query that sees
none (a fully masked padding row) gets output 0 and zero gradients from every fast path (the
reference averages all keys uniformly there). Static shape errors are ValueErrors raised at
trace time, before anything is lowered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from v41jax.kernels.attention.blockwise import blockwise_attention
from v41jax.kernels.attention.common import AttentionLayout
from v41jax.kernels.attention.dot_product import cudnn_limits, dot_product_attention
from v41jax.kernels.attention.reference import causal_attention
from v41jax.kernels.attention.splash import LANES, splash_attention

IMPLS = ("auto", "reference", "blockwise", "dot_product", "splash")

__all__ = ["IMPLS", "AttentionLayout", "attend"]


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(f"attend: {msg}")


def _validate(q, k, v, layout: AttentionLayout, impl: str, block_size) -> None:
    _need(impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    _need(
        isinstance(block_size, int) and block_size > 0,
        f"block_size must be a positive int, got {block_size!r}",
    )
    _need(q.ndim == 4 and k.ndim == 4, f"q [B,T,H,K], k/v [B,S,G,K]; got {q.shape}, {k.shape}")
    _need(k.shape == v.shape, f"k and v shapes differ: {k.shape} vs {v.shape}")
    (b, t, h, kd), (bk, s, g, kk) = q.shape, k.shape
    _need(b == bk and kd == kk, f"q {q.shape} and k {k.shape} disagree on batch or head dim")
    _need(g > 0 and h % g == 0, f"num_heads={h} must be a multiple of num_kv_heads={g}")
    _need(
        jnp.issubdtype(q.dtype, jnp.floating) and q.dtype == k.dtype == v.dtype,
        f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
    )
    shapes = [
        ("q_positions_BxT", layout.q_positions_BxT, (b, t)),
        ("kv_positions_BxS", layout.kv_positions_BxS, (b, s)),
    ]
    _need(
        (layout.q_segment_ids_BxT is None) == (layout.kv_segment_ids_BxS is None),
        "give both q and kv segment ids or neither",
    )
    if layout.has_segments:
        shapes += [
            ("q_segment_ids_BxT", layout.q_segment_ids_BxT, (b, t)),
            ("kv_segment_ids_BxS", layout.kv_segment_ids_BxS, (b, s)),
        ]
    for name, arr, want in shapes:
        _need(tuple(arr.shape) == want, f"layout.{name} must be {list(want)}, got {arr.shape}")
        _need(jnp.issubdtype(arr.dtype, jnp.integer), f"layout.{name} must be int: {arr.dtype}")
    if impl == "splash":
        _need(
            block_size % LANES == 0,
            f"splash blocks are multiples of {LANES} (TPU lanes), got block_size={block_size}",
        )


def attend(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    layout: AttentionLayout,
    *,
    impl: str = "auto",
    block_size: int = 512,
) -> jax.Array:
    """`softmax(q k^T / sqrt(K) + visibility) v` per query head ([B, T, H, K]).

    Query head h reads kv head h // (H / G). `block_size`: query/key block of the blockwise
    and splash paths (splash rounds it down to a multiple of 128 under "auto").
    """
    _validate(q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout, impl, block_size)
    args = (q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout)
    if impl == "reference":
        return causal_attention(*args[:3], layout.mask())

    # One function object per path, so platform_dependent merges branches that coincide.
    def blockwise(q, k, v, layout):
        return blockwise_attention(q, k, v, *layout, block_size=block_size)

    if impl == "blockwise":
        return blockwise(*args)

    def dot_product(implementation):
        return functools.partial(
            dot_product_attention, implementation=implementation, block_size=block_size
        )

    def splash(block, interpret):
        return functools.partial(splash_attention, block_size=block, interpret=interpret)

    cudnn_ok = cudnn_limits(q_BxTxHxK, k_BxSxGxK) is None
    if impl == "dot_product":
        xla = dot_product("xla")
        cuda = dot_product("cudnn") if cudnn_ok else xla
        return jax.lax.platform_dependent(*args, cuda=cuda, default=xla)
    if impl == "splash":
        return jax.lax.platform_dependent(
            *args, tpu=splash(block_size, False), default=splash(block_size, True)
        )
    # impl == "auto"
    tpu_block = max(LANES, block_size // LANES * LANES)
    return jax.lax.platform_dependent(
        *args,
        cpu=blockwise,
        cuda=dot_product("cudnn") if cudnn_ok else blockwise,
        tpu=splash(tpu_block, False),
        default=blockwise,
    )
