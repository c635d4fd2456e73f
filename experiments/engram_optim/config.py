"""Engram's table optimizers and V4.1's recipe, at equal steps: which trains the best model?

A run is (table params, optimizer, recipe, lr, seed). `optimizer` names the tables' rule:

    adam             dense AdamW over the whole table, at 1x the base LR
    adam_5x          the same at 5x (the Engram paper's table LR)
    sparse_adam      lazy Adam on the rows a batch reads (5x)
    rowwise_adagrad  one accumulator per row (5x)
    sinkhorn         the dense Sinkhorn-balanced update (5x x gamma 0.18)
    sinkhorn_sparse  its row-sparse form (5x x gamma 0.18)

with the rest of the model on AdamW (`recipe` "adamw"), plus `recipe` "v41" (Muon for the
matrices, the Sinkhorn-balanced update for tables, embedding and head: `optim.recipe=v41`)
with dense `sinkhorn` tables. `lr` is the base learning rate (`optim.lr`: the backbone's;
the tables take it x their scale). "adamw everywhere" is the `adam_5x` run.

Two stages per table size: every (optimizer or recipe, lr) at seed 0; then the other
seeds at each one's best lr (lowest seed-0 val loss). `first_stage(setting)` lists stage 1;
`second_stage(setting, best)` stage 2 given the best lr per (size, optimizer, recipe).
"""

from __future__ import annotations

from v41jax import config as config_lib

# (tables' optimizer, model.engram.table_lr_scale)
OPTIMIZERS = {
    "adam": ("adam", 1.0),
    "adam_5x": ("adam", 5.0),
    "sparse_adam": ("sparse_adam", 5.0),
    "rowwise_adagrad": ("rowwise_adagrad", 5.0),
    "sinkhorn": ("sinkhorn", 5.0),
    "sinkhorn_sparse": ("sinkhorn_sparse", 5.0),
}
ROW_SPARSE = ("sparse_adam", "rowwise_adagrad", "sinkhorn_sparse")
DENSE_ADAM = ("adam", "adam_5x")
ORDERS = 2  # max_ngram_size 3: 2-grams and 3-grams
SETTINGS = {
    # base config, Engram layers, heads per order x row width, table sizes, steps, lrs, seeds
    "full": dict(
        base="small",
        layers=(1, 2),
        heads=4,
        head_dim=32,
        sizes=(1e6, 1e8),
        steps=1000,
        lrs=(1e-3, 3e-3, 1e-2),
        seeds=(0, 1),
        eval_batches=16,
    ),
    "quick": dict(
        base="tiny",
        layers=(0, 1),
        heads=2,
        head_dim=16,
        sizes=(1e5,),
        steps=24,
        lrs=(3e-3, 1e-2),
        seeds=(0, 1),
        eval_batches=4,
    ),
}


def run_name(run) -> str:
    size, opt, recipe, lr, seed = run
    arm = opt if recipe == "adamw" else f"recipe_{recipe}"
    return f"{size:.0e}/{arm}_lr{lr:g}_seed{seed}".replace("+", "")


def first_stage(setting: str) -> list[tuple]:
    """(table params, optimizer, recipe, lr, seed 0) of every stage-1 run, in run order:
    the smaller tables first, each optimizer over its lrs, then the v41 recipe."""
    s = SETTINGS[setting]
    seed = s["seeds"][0]
    out = []
    for size in s["sizes"]:
        for opt in OPTIMIZERS:
            out += [(size, opt, "adamw", lr, seed) for lr in s["lrs"]]
        out += [(size, "sinkhorn", "v41", lr, seed) for lr in s["lrs"]]
    return out


def arm(run) -> tuple:
    """(table params, optimizer, recipe): the runs that differ only in lr and seed."""
    return run[:3]


def second_stage(setting: str, best_lr: dict) -> list[tuple]:
    """The other seeds at each arm's best lr ({arm: lr}), in the first stage's order."""
    s = SETTINGS[setting]
    out, seen = [], set()
    for run in first_stage(setting):
        key = arm(run)
        if key in seen or key not in best_lr:
            continue
        seen.add(key)
        out += [(*key, best_lr[key], seed) for seed in s["seeds"][1:]]
    return out


def table_vocab(size: float, setting: str) -> int:
    """engram_vocab_size per order so that the tables of all layers hold about `size` params."""
    s = SETTINGS[setting]
    per_row = len(s["layers"]) * ORDERS * s["heads"] * s["head_dim"]
    return max(int(size / per_row), 64)


def get_config(run, setting: str = "full") -> config_lib.Config:
    size, opt, recipe, lr, seed = run
    s = SETTINGS[setting]
    table_optimizer, scale = OPTIMIZERS[opt]
    vocab = table_vocab(size, setting)
    steps = s["steps"]
    sets = [
        f"name=engram_optim_{run_name(run).replace('/', '_')}",
        "model.engram.layer_ids=" + ",".join(str(x) for x in s["layers"]),
        f"model.engram.engram_vocab_size={vocab},{vocab}",
        f"model.engram.n_embed_per_ngram={s['heads'] * s['head_dim']}",
        f"model.engram.n_head_per_ngram={s['heads']}",
        f"model.engram.table_lr_scale={scale}",
        f"optim.table_optimizer={table_optimizer}",
        f"optim.recipe={recipe}",
        f"optim.lr={lr}",
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"train.steps={steps}",
        f"train.log_every={max(steps // 50, 1)}",
        f"train.checkpoint_every={max(steps // 4, 1)}",
        "train.eval_every=0",
        f"train.eval_batches={s['eval_batches']}",
        "mesh.data=1",
    ]
    return config_lib.override(config_lib.get_config(s["base"]), sets)
