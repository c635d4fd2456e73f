"""Parameter and FLOP accounting of a `ModelConfig`: where the parameters sit, which ones a
token uses, and the training FLOPs per token.

    total  = every scalar the model initialises (abstract shapes via `jax.eval_shape`)
    active = total - sum_{MoE layers} (E - k) * P_e - sum_{Engram layers} (R_l - H) * d_h

P_e = 3 * D * F_e is one routed expert; R_l the rows layer l's Engram table stores (its
primes plus alignment padding), H = (max_ngram_size - 1) * n_head_per_ngram the rows one
token reads there (one per hash head) and d_h the Engram head dim.

    flops_per_token = 6 * N_matmul + 12 * L * H_q * K * T      (PaLM appendix B: fwd + bwd)

N_matmul counts the weights a token multiplies: per layer attention D*H_q*K + 2*D*G*K +
H_q*K*D and FFN (dense 3*D*F; MoE D*E router + (k + S) * 3*D*F_e, the k routed and S shared
experts it runs), per Engram layer W_V (E_m*D) + W_K (M*E_m*D) (+ conv taps kernel*M*D),
per mHC sub-layer phi (n*C x (n^2 + 2n)), and the head D*V (tied or not). Embedding lookups
and table gathers are not matmuls; norms, biases and gates are O(D) per token and left out.
The second term is the attention scores and weighted sum over a full, non-causal T x T
window, as in the usual MFU accounting. Dispatch overhead (empty buffer rows of a dropless
MoE, see moe.py) is not model FLOPs and is not counted.
"""

from __future__ import annotations

import functools
import math

import jax
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig
from v41jax.model.layout import first_layer_of_path
from v41jax.model.moe import expert_width, is_moe_layer, moe_layers
from v41jax.model.transformer import init_params

ROUTED = ("w_gate", "w_up", "w_down")  # the [E, ...] expert stacks of an MoE FFN


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """N_matmul of the module docstring: the weights one token multiplies (fwd pass)."""
    d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    attn = d * h * k + 2 * d * g * k + h * k * d
    n = attn * cfg.num_layers + d * cfg.vocab_size
    for layer in range(cfg.num_layers):
        if is_moe_layer(cfg, layer):
            m = cfg.moe
            n += d * m.num_experts + (m.top_k + m.num_shared_experts) * 3 * d * expert_width(cfg)
        else:
            n += 3 * d * cfg.d_ff
    e, branches = cfg.engram, max(cfg.mhc.n_streams, 1)
    per_engram = e.embed_dim * d * (1 + branches)
    per_engram += e.kernel_size * branches * d if e.use_short_conv else 0
    n += len(e.layer_ids) * per_engram
    if cfg.mhc.enabled:  # one phi [n*C, n^2 + 2n] per sub-layer (attention and FFN)
        s = cfg.mhc.n_streams
        n += cfg.num_layers * 2 * s * d * (s * s + 2 * s)
    return n


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix-B convention:

        6 * N_matmul + 12 * L * H * K * T

    N_matmul = `matmul_params_per_token(cfg)`; for a dense model without Engram or mHC it is
    L * (D*H*K + 2*D*G*K + H*K*D + 3*D*F) + D*V. The second term is the attention scores
    and weighted sum (2 matmuls x 2 flops x 3 for fwd+bwd) over a full T x T window.
    """
    h, k = cfg.num_heads, cfg.resolved_head_dim
    return float(6 * matmul_params_per_token(cfg) + 12 * cfg.num_layers * h * k * seq_len)


@functools.cache
def _param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """`{path: shape}` of every param of `Transformer(cfg)`, from abstract init (no memory)."""
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    return {p: v.shape for p, v in traverse_util.flatten_dict(nn.unbox(abstract)).items()}


def param_accounting(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int | float]:
    """Parameter and FLOP budget of `cfg` (module docstring), all counts in scalars:

    total_params, active_params (per token), embedding_params (the [V, D] table),
    engram_params (tables incl. alignment rows + projections and norms; engram_table_params
    the tables alone), moe_params (router, routed and shared experts of the MoE layers;
    routed_expert_params the [E, ...] stacks alone), dense_ffn_params (the dense FFN layers),
    matmul_params_per_token (N_matmul) and flops_per_token at `seq_len` (default
    cfg.max_seq_len).
    """
    shapes = _param_shapes(cfg)

    def size(keep) -> int:
        return sum(math.prod(shape) for path, shape in shapes.items() if keep(path))

    def in_ffn(path, moe: bool) -> bool:
        return path[1:2] == ("ffn",) and is_moe_layer(cfg, _layer(path)) == moe

    routed = size(lambda p: in_ffn(p, True) and len(p) == 3 and p[2] in ROUTED)
    tables = size(lambda p: p[1:] == ("engram", "table"))
    m, rows_read = cfg.moe, cfg.engram.num_heads_total
    unused_experts = routed * (m.num_experts - m.top_k) // m.num_experts if m.num_experts else 0
    unread_rows = tables - len(cfg.engram.layer_ids) * rows_read * cfg.engram.head_dim
    total = size(lambda p: True)
    return {
        "total_params": total,
        "active_params": total - unused_experts - unread_rows,
        "embedding_params": size(lambda p: p == ("embed", "embedding")),
        "engram_params": size(lambda p: p[1:2] == ("engram",)),
        "engram_table_params": tables,
        "moe_params": size(lambda p: in_ffn(p, True)),
        "routed_expert_params": routed,
        "dense_ffn_params": size(lambda p: in_ffn(p, False)),
        "moe_layers": len(moe_layers(cfg)),
        "matmul_params_per_token": matmul_params_per_token(cfg),
        "flops_per_token": model_flops_per_token(cfg, seq_len or cfg.max_seq_len),
    }


def _layer(path: tuple[str, ...]) -> int:
    """Block index of a param path ("block_3", ...; the first layer of a scanned
    "layers_2_5", whose layers share one FFN kind); -1 outside the blocks."""
    return first_layer_of_path(path)
