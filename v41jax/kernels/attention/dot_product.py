"""`jax.nn.dot_product_attention` behind the layout: cuDNN flash attention when lowered for
CUDA, jax.nn's XLA implementation elsewhere.

What the JAX 0.10.2 signature can say: `is_causal` (index-causal, top-left aligned: query t
sees keys s <= t), `query_seq_lengths` / `key_value_seq_lengths` (per-row padding), GQA
(k/v with G heads, H % G == 0), and a `bias` / boolean `mask` broadcastable to [B, H, T, S].
It cannot say packed segments (cuDNN's packed layout takes segment offsets, but
jax.nn.dot_product_attention does not expose them) nor a per-row causal offset (KV-cache
queries at slots cache_index[b] + t over S slots) without a [B, T, S] mask, so:

  segment ids given                  -> blockwise (no [B, T, S] mask is ever built)
  T == S                             -> is_causal=True if `common.index_causal(layout)`
                                        holds on device, else blockwise (`lax.cond`)
  T == 1 (decode)                    -> key_value_seq_lengths = #{s: kv_pos[s] <= q_pos}
                                        if kv positions are sorted on device (the visible
                                        keys are then a prefix), else blockwise
  anything else (cache with T > 1)   -> blockwise

cuDNN also needs fp16/bf16 inputs and a head dim that is a multiple of 8 and <= 128
(`cudnn_limits`); `attend(impl="auto")` sends other shapes to blockwise. Note the device
check is a `lax.cond`: on GPU its predicate is read by the host once per call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from v41jax.kernels.attention.blockwise import blockwise_attention
from v41jax.kernels.attention.common import AttentionLayout, index_causal

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds on every cuDNN-capable GPU


def cudnn_version() -> int | None:
    """The cuDNN version jaxlib was built against, or None (a CPU-only jaxlib).

    The same probe `jax.nn.dot_product_attention(implementation="cudnn")` runs at trace
    time (it raises without cuDNN), so the two can never disagree.
    """
    try:
        from jax._src.cudnn import fused_attention_stablehlo as _fa

        return int(_fa.check_cudnn_version())
    except (ImportError, RuntimeError, AttributeError):
        return None


def cudnn_limits(q_BxTxHxK: jax.Array, k_BxSxGxK: jax.Array) -> str | None:
    """Why cuDNN flash attention cannot take these inputs, or None if it can."""
    if cudnn_version() is None:
        return "this jaxlib has no cuDNN"
    if q_BxTxHxK.dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes float16/bfloat16, got {q_BxTxHxK.dtype}"
    kd = q_BxTxHxK.shape[-1]
    if kd % 8 or kd > CUDNN_MAX_HEAD_DIM:
        return f"cuDNN head dim must be a multiple of 8 and <= {CUDNN_MAX_HEAD_DIM}, got {kd}"
    return None


def _blockwise(q, k, v, layout, block_size):
    return blockwise_attention(q, k, v, *layout, block_size=block_size)


def dot_product_attention(
    q_BxTxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    layout: AttentionLayout,
    *,
    implementation: str,
    block_size: int = 512,
) -> jax.Array:
    """Attention by `jax.nn.dot_product_attention(implementation=...)` where the layout can
    be said with its causal flag or key lengths, else by the blockwise path (module
    docstring); [B, T, H, K]. `implementation` is "cudnn" or "xla"."""
    t, s = q_BxTxHxK.shape[1], k_BxSxGxK.shape[1]
    fallback = functools.partial(_blockwise, block_size=block_size)
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=implementation)
    args = (q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, layout)
    if layout.has_segments or t == 0 or s == 0:
        return fallback(*args)
    if t == s:

        def causal(q, k, v, layout):
            return dpa(q, k, v, is_causal=True)

        return jax.lax.cond(index_causal(layout), causal, fallback, *args)
    if t == 1:
        kv_pos = layout.kv_positions_BxS
        sorted_kv = jnp.all(kv_pos[:, 1:] >= kv_pos[:, :-1])

        def prefix(q, k, v, layout):
            seen_B = jnp.sum(layout.kv_positions_BxS <= layout.q_positions_BxT, axis=1)
            # A row that sees no key gets 0 (blockwise's convention); the kernel reads one
            # key there so that no 0/0 reaches its output or its gradient.
            out = dpa(q, k, v, key_value_seq_lengths=jnp.maximum(seen_B, 1).astype(jnp.int32))
            return jnp.where((seen_B > 0)[:, None, None, None], out, jnp.zeros_like(out))

        return jax.lax.cond(sorted_kv, prefix, fallback, *args)
    return fallback(*args)
