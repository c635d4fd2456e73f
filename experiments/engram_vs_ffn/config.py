"""Engram vs an equal-parameter dense FFN, and experts vs Engram at a fixed sparse budget.

    python -m v41jax sweep experiments/engram_vs_ffn/config.py [--setting full|mini|large]
    python -m v41jax report experiments/engram_vs_ffn

Studies (`RunSpec.study`; every run of a setting sees the same tokens: same steps, batch and
sequence length, and the data order of its seed):

- `quality_per_param` (Study 1): the baseline; baseline + Engram at layer `engram.layer_ids`
  adding P parameters (tables sized by `size_tables_for_budget`; P = the accounting's total
  minus the baseline's); baseline with d_ff widened to add the same P (the integer d_ff whose
  count is closest). P spans `p_targets`, each arm with every seed.
- `allocation` (Study 2): every layer's FFN is an MoE of top_k routed + shared experts of
  width d_expert, with (top_k + shared) * d_expert = the baseline d_ff, so the active FFN
  compute is the baseline's whatever the split. A sparse budget of B = `budget_experts`
  extra experts' parameters (in every layer) is split: rho * B as routed experts beyond top_k,
  the rest as Engram parameters. rho = 1 is pure MoE, rho = 0 pure Engram (E = top_k: all
  experts active).
- Study 3 (analysis only): Engram arms of Study 1 carry `engram_off` (val loss with the
  value path zeroed, by token type); baseline and FFN arms `token_split` (their losses by
  token type), computed after each run; the report takes the best Engram run.

Settings: `full` fits about 2 hours on the 2-core dev VM (README.md has the measured
per-step times); `mini` is a miniature of every study (tiny model, one seed, a few minutes;
the slow test runs it); `large` is for one accelerator (never run here; it needs a larger
corpus than the default's 2.7 M training tokens: add `--set data.paths=...`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from v41jax.config import Config, DataConfig, ModelConfig, MoEConfig, OptimConfig, TrainConfig
from v41jax.engram import EngramConfig
from v41jax.sweep import RunSpec, engram_for_budget, ffn_width_for, total_params

SETTINGS = ("full", "mini", "large")


@dataclass(frozen=True)
class Scale:
    data: DataConfig
    model: ModelConfig  # the baseline
    engram: EngramConfig  # placement and widths; tables are sized per P
    p_targets: tuple[int, ...]  # Study 1 parameter additions
    seeds: tuple[int, ...]
    steps: int
    eval_batches: int
    rhos: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    budget_experts: int = 12  # Study 2 sparse budget, in extra routed experts per layer
    top_k: int = 2
    num_shared_experts: int = 1
    d_expert: int = 128
    capacity_factor: float = 1.5  # drops (if any) are logged and reported
    lr: float = 3e-3
    warmup_steps: int = 40


SCALES = {
    "full": Scale(
        data=DataConfig(vocab_size=4096, seq_len=128, global_batch_size=16),
        model=ModelConfig(
            vocab_size=4096, d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, d_ff=384
        ),
        engram=EngramConfig(
            layer_ids=(1,), max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4
        ),
        p_targets=(200_000, 600_000, 2_000_000),
        seeds=(0, 1),
        steps=800,
        eval_batches=32,
    ),
    "mini": Scale(
        data=DataConfig(vocab_size=512, seq_len=64, global_batch_size=8, max_documents=40),
        model=ModelConfig(
            vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, d_ff=128
        ),
        engram=EngramConfig(
            layer_ids=(1,), max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=2
        ),
        p_targets=(10_000, 30_000, 100_000),
        seeds=(0,),
        steps=30,
        eval_batches=4,
        budget_experts=4,
        top_k=1,
        d_expert=64,
        warmup_steps=5,
    ),
    "large": Scale(
        data=DataConfig(vocab_size=4096, seq_len=512, global_batch_size=64),
        model=ModelConfig(
            vocab_size=4096, d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1536
        ),
        engram=EngramConfig(
            layer_ids=(1,), max_ngram_size=3, n_embed_per_ngram=256, n_head_per_ngram=8
        ),
        p_targets=(8_000_000, 32_000_000, 128_000_000),
        seeds=(0, 1, 2),
        steps=5000,
        eval_batches=4,  # all the default corpus's validation split holds at 64 x 512
        budget_experts=16,
        d_expert=512,
        capacity_factor=1.25,
        lr=1e-3,
        warmup_steps=200,
    ),
}


def _config(s: Scale, name: str, seed: int, model: ModelConfig) -> Config:
    model = dataclasses.replace(model, max_seq_len=s.data.seq_len)
    return Config(
        name=name,
        data=dataclasses.replace(s.data, seed=seed),  # data order follows the seed
        model=model,
        optim=OptimConfig(lr=s.lr, warmup_steps=s.warmup_steps),
        train=TrainConfig(
            steps=s.steps,
            seed=seed,
            log_every=max(1, s.steps // 40),
            eval_every=max(1, s.steps // 2),
            eval_batches=s.eval_batches,
            checkpoint_every=max(1, s.steps // 4),
            keep_checkpoints=2,
        ),
    )


def _short(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def quality_runs(s: Scale) -> list[RunSpec]:
    """Study 1 (module docstring), seed-major so a partial sweep has whole seeds."""
    base_total = total_params(s.model)
    arms = [("baseline", s.model, {"kind": "baseline", "p_added": 0}, ("token_split",))]
    for i, p in enumerate(s.p_targets):
        engram = engram_for_budget(s.model, s.engram, p)
        with_engram = dataclasses.replace(s.model, engram=engram)
        added = total_params(with_engram) - base_total
        d_ff = ffn_width_for(s.model, added)
        wide = dataclasses.replace(s.model, d_ff=d_ff)
        meta = {"p_target": p, "p_index": i}
        arms.append(
            (
                f"engram_{_short(p)}",
                with_engram,
                meta
                | {"kind": "engram", "p_added": added, "table_sizes": engram.engram_vocab_size},
                ("engram_off",),
            )
        )
        meta_ffn = meta | {"kind": "ffn", "p_added": total_params(wide) - base_total, "d_ff": d_ff}
        arms.append((f"ffn_{_short(p)}", wide, meta_ffn, ("token_split",)))
    return [
        RunSpec(
            "quality_per_param",
            arm,
            seed,
            _config(s, f"quality_{arm}_seed{seed}", seed, model),
            eval_only_analysis=analysis,
            meta=meta,
        )
        for seed in s.seeds
        for arm, model, meta, analysis in arms
    ]


def allocation_runs(s: Scale) -> list[RunSpec]:
    """Study 2 (module docstring): rho of the budget in routed experts, the rest in Engram."""
    m = s.model
    if (s.top_k + s.num_shared_experts) * s.d_expert != m.d_ff:
        raise ValueError(
            f"active FFN width (top_k={s.top_k} + shared={s.num_shared_experts}) * "
            f"d_expert={s.d_expert} must equal the baseline d_ff={m.d_ff}"
        )
    expert_params = 3 * m.d_model * s.d_expert * m.num_layers  # one more expert in every layer
    budget = s.budget_experts * expert_params
    runs = []
    for seed in s.seeds:
        for rho in s.rhos:
            extra = rho * s.budget_experts
            if abs(extra - round(extra)) > 1e-9:
                raise ValueError(
                    f"rho={rho} x budget_experts={s.budget_experts} = {extra} is not a whole "
                    "number of experts"
                )
            extra = round(extra)
            moe = MoEConfig(
                num_experts=s.top_k + extra,
                top_k=s.top_k,
                num_shared_experts=s.num_shared_experts,
                d_expert=s.d_expert,
                capacity_factor=s.capacity_factor,
            )
            engram_budget = budget - extra * expert_params
            engram = (
                engram_for_budget(m, s.engram, engram_budget) if engram_budget else EngramConfig()
            )
            model = dataclasses.replace(m, moe=moe, engram=engram)
            arm = f"rho{rho:.2f}"
            meta = {
                "rho": rho,
                "num_experts": moe.num_experts,
                "sparse_budget": budget,
                "expert_budget": extra * expert_params,
                "engram_budget": engram_budget,
            }
            cfg = _config(s, f"allocation_{arm}_seed{seed}", seed, model)
            runs.append(RunSpec("allocation", arm, seed, cfg, meta=meta))
    return runs


def get_sweep(setting: str = "full") -> list[RunSpec]:
    if setting not in SCALES:
        raise ValueError(f"unknown setting {setting!r}; settings: {list(SCALES)}")
    s = SCALES[setting]
    return quality_runs(s) + allocation_runs(s)
