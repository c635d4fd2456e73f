"""Engram at scale: one small model, Engram tables from 1e6 to 1e10 parameters, on the
device, in host memory and in memory-mapped files, per table optimizer.

A cell is (table params, placement, optimizer). `cells(setting)` lists the cells a setting
runs; `get_config(cell, setting)` is its run config. Dense `adam` runs on the device only
(the host paths need a row-sparse optimizer) and only while its dense table, gradient and
two moments fit this machine; device and host cells stop where the table and its state no
longer fit RAM; the file placement goes past RAM (1e10 parameters = 40 GB of float32 rows on
a 24 GiB machine: a lazy file holds only the rows training wrote).
"""

from __future__ import annotations

from v41jax import config as config_lib

HEAD_DIM, HEADS_PER_ORDER, ORDERS = 16, 4, 2  # 8 tables of 16-wide rows, one Engram layer
OPTIMIZERS = ("adam", "sparse_adam", "rowwise_adagrad")
PLACEMENTS = ("device", "host", "file")
SETTINGS = {
    # sizes, steps, and the largest size per (optimizer, placement) ("*": any placement)
    "full": dict(
        sizes=(1e6, 1e8, 1e9, 1e10),
        steps=100,
        max_size={
            ("adam", "*"): 1e8,
            ("sparse_adam", "device"): 1e8,
            ("sparse_adam", "host"): 1e8,
            ("rowwise_adagrad", "device"): 1e9,
            ("rowwise_adagrad", "host"): 1e9,
        },  # fmt: skip
    ),
    "quick": dict(sizes=(1e5, 1e6), steps=12, max_size={}),
}


def cells(setting: str) -> list[tuple[float, str, str]]:
    """(table params, placement, optimizer) of every run of `setting`, in run order."""
    s = SETTINGS[setting]
    out = []
    for size in s["sizes"]:
        for opt in OPTIMIZERS:
            for place in PLACEMENTS:
                if opt == "adam" and place != "device":
                    continue  # host and file tables need a row-sparse optimizer
                cap = s["max_size"].get((opt, place), s["max_size"].get((opt, "*"), 1e99))
                if size <= cap:
                    out.append((size, place, opt))
    return out


def cell_name(cell) -> str:
    size, place, opt = cell
    return f"{opt}_{place}_{size:.0e}".replace("+", "")


def get_config(cell, setting: str = "full") -> config_lib.Config:
    size, place, opt = cell
    vocab = max(int(size / (HEAD_DIM * HEADS_PER_ORDER * ORDERS)), 64)
    steps = SETTINGS[setting]["steps"]
    sets = [
        f"name=engram_scale_{cell_name(cell)}",
        "model.num_layers=4",
        "model.engram.layer_ids=1",
        f"model.engram.engram_vocab_size={vocab},{vocab}",
        f"model.engram.n_embed_per_ngram={HEAD_DIM * HEADS_PER_ORDER}",
        f"model.engram.n_head_per_ngram={HEADS_PER_ORDER}",
        f"optim.table_optimizer={opt}",
        f"train.steps={steps}",
        f"train.log_every={max(steps // 20, 1)}",
        f"train.checkpoint_every={max(steps // 2, 1)}",
        "train.eval_every=0",
        "train.eval_batches=8",
        "mesh.data=1",  # one device: the placements reduce gradients in the same order
    ]
    if place != "device":
        sets.append("model.engram.table_placement=host")
    if place == "file":
        sets.append("model.engram.table_path=tables")
    return config_lib.override(config_lib.get_config("tiny"), sets)
