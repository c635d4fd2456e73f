"""Parameter/FLOP accounting: totals equal the initialised params, active params and FLOPs
checked by hand, and N_matmul equal to a count over the param tree's matmul weights."""

import dataclasses
import math

import jax
import pytest
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig, MoEConfig
from v41jax.engram.config import EngramConfig
from v41jax.mhc.config import MHCConfig
from v41jax.model import (
    count_params,
    init_params,
    matmul_params_per_token,
    model_flops_per_token,
    param_accounting,
)

# D=32, V=64, L=2, H=4, G=2, K=8, F=48
DENSE = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48, max_seq_len=32
)
MOE = dataclasses.replace(
    DENSE, moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, d_expert=16, layer_ids=(1,))
)
# orders 2 and 3, 2 heads each: primes 53, 59 (order 2) and 61, 67 (order 3) = 240 rows,
# stored as 256 (aligned to 64); head dim 8, memory width E_m = 2 * 16 = 32.
ENGRAM = dataclasses.replace(
    DENSE,
    engram=EngramConfig(
        engram_vocab_size=(50, 50),
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        layer_ids=(0,),
        table_row_align=64,
    ),
)
ATTN = 32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32  # q, k, v, o = 3072
NORMS = 2 * 32  # attn_norm, ffn_norm per block
DENSE_FFN = 3 * 32 * 48  # 4608
EMBED = 64 * 32  # 2048
EXPERT = 3 * 32 * 16  # one routed (or the one shared) expert: 1536


@pytest.mark.parametrize("cfg", [DENSE, MOE, ENGRAM], ids=["dense", "moe", "engram"])
def test_total_params_equal_the_initialised_params(cfg):
    # rbg keys: the same init, compiled ~3x faster than threefry on CPU
    params = init_params(cfg, jax.random.key(0, impl="rbg"))
    assert param_accounting(cfg)["total_params"] == count_params(params)


def test_dense_accounting_by_hand():
    acc = param_accounting(DENSE)
    total = EMBED + 2 * (ATTN + NORMS + DENSE_FFN) + 32
    assert acc["total_params"] == acc["active_params"] == total == 17568
    assert acc["dense_ffn_params"] == 2 * DENSE_FFN and acc["moe_params"] == 0
    assert acc["engram_params"] == 0 and acc["embedding_params"] == EMBED
    n_matmul = 2 * (ATTN + DENSE_FFN) + EMBED  # the tied head is a matmul
    assert acc["matmul_params_per_token"] == n_matmul
    assert acc["flops_per_token"] == 6 * n_matmul + 12 * 2 * 4 * 8 * 32  # T = max_seq_len


def test_moe_accounting_by_hand():
    acc = param_accounting(MOE, seq_len=16)
    moe = 32 * 4 + 4 * EXPERT + EXPERT  # router, 4 routed experts, 1 shared
    assert acc["moe_params"] == moe == 7808 and acc["routed_expert_params"] == 4 * EXPERT
    assert acc["dense_ffn_params"] == DENSE_FFN  # layer 0 stays dense
    total = EMBED + 2 * (ATTN + NORMS) + DENSE_FFN + moe + 32
    assert acc["total_params"] == total == 20768
    assert acc["active_params"] == total - (4 - 2) * EXPERT == 17696  # top-2 of 4 run
    n_matmul = 2 * ATTN + DENSE_FFN + 32 * 4 + (2 + 1) * EXPERT + EMBED
    assert acc["matmul_params_per_token"] == n_matmul == 17536
    assert acc["flops_per_token"] == 6 * 17536 + 12 * 2 * 4 * 8 * 16
    assert acc["moe_layers"] == 1


def test_engram_accounting_by_hand():
    acc = param_accounting(ENGRAM)
    table = 256 * 8
    projections = 32 * 32 + 32 + 32 * 32 + 32 + 2 * 32  # W_V, b_V, W_K, b_K, two norms
    assert acc["engram_table_params"] == table
    assert acc["engram_params"] == table + projections == 4224
    assert acc["total_params"] == 17568 + 4224
    # a token reads one row per head and order: (3 - 1) * 2 = 4 rows of 8
    assert acc["active_params"] == 17568 + 4224 - (256 - 4) * 8 == 19776
    assert acc["matmul_params_per_token"] == 2 * (ATTN + DENSE_FFN) + EMBED + 2 * 32 * 32


MATMUL_WEIGHTS = {"q", "k", "v", "o", "w_gate", "w_up", "w_down", "router", "w_v", "w_k"}
MATMUL_WEIGHTS |= {"conv_kernel", "phi", "head"}


def matmul_params_from_tree(cfg: ModelConfig) -> int:
    """N_matmul counted over the real param tree: every matmul weight, the routed expert
    stacks scaled by k / E, the embedding only as the tied head."""
    boxed = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    n = 0
    for path, leaf in traverse_util.flatten_dict(nn.unbox(boxed)).items():
        size = math.prod(leaf.shape)
        if path[-1] == "embedding" and cfg.tie_embeddings:
            n += size
        elif path[-1] in MATMUL_WEIGHTS:
            in_moe = path[1:2] == ("ffn",) and "router" in boxed[path[0]]["ffn"]
            routed = in_moe and len(path) == 3 and path[-1] != "router"
            n += size * cfg.moe.top_k // cfg.moe.num_experts if routed else size
    return n


EVERYTHING = dataclasses.replace(
    MOE,
    num_layers=3,
    tie_embeddings=False,
    moe=dataclasses.replace(MOE.moe, layer_ids=(0, 2), top_k=3, num_shared_experts=2),
    engram=dataclasses.replace(ENGRAM.engram, layer_ids=(1, 2), use_short_conv=True),
    mhc=MHCConfig(n_streams=2),
)


@pytest.mark.parametrize(
    "cfg", [DENSE, MOE, ENGRAM, EVERYTHING], ids=["dense", "moe", "engram", "everything"]
)
def test_matmul_params_match_the_param_tree(cfg):
    assert matmul_params_per_token(cfg) == matmul_params_from_tree(cfg)
    t = 24
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * t
    assert model_flops_per_token(cfg, t) == 6 * matmul_params_per_token(cfg) + attention


def test_every_expert_active_when_top_k_is_num_experts():
    cfg = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, top_k=4))
    acc = param_accounting(cfg)
    assert acc["active_params"] == acc["total_params"]
