"""The run's files besides checkpoints and metrics: config.json, config_changes.jsonl,
tokenizer.json and compression.npz, read and written through `etils.epath` (the workdir
may be gs://...: `v41jax.train.workdir`)."""

from __future__ import annotations

import json
import os

import jax
from etils import epath

from v41jax.config import Config
from v41jax.data import CompressionTable, PreparedData, Tokenizer, load_data
from v41jax.data.tokenizer import TOKENIZER_CONFIG
from v41jax.train import workdir as workdir_lib


def load_tokenizer(run: epath.Path) -> Tokenizer:
    return workdir_lib.read_via_local(
        run / "tokenizer.json", Tokenizer.load, companions=(TOKENIZER_CONFIG,)
    )


def load_compression(run: epath.Path) -> CompressionTable:
    return workdir_lib.read_via_local(run / "compression.npz", CompressionTable.load)


def prepare(cfg: Config, workdir: epath.Path, progress: bool) -> PreparedData:
    """Tokenized data for the run; writes nothing. A resumed run keeps the tokenizer saved in
    its workdir, a fine-tuning run its source's, whatever text it trains on now."""
    init_from = workdir_lib.as_path(cfg.train.init_from) if cfg.train.init_from else None
    source = workdir if (workdir / "tokenizer.json").exists() else init_from
    tokenizer = load_tokenizer(source) if source else None
    data = load_data(cfg.data, show_progress=progress, tokenizer=tokenizer)  # or token_dir
    if data.tokenizer.vocab_size > cfg.model.vocab_size:  # more embedding rows may pad it
        where = f" (the tokenizer of {os.fspath(source)})" if source else ""
        raise ValueError(
            f"tokenizer has {data.tokenizer.vocab_size} tokens{where} but "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    return data


def write_run_files(
    cfg: Config, workdir: epath.Path, data: PreparedData, changes: list[str], step: int | None
) -> None:
    """config.json, tokenizer.json, compression.npz: written only once every check passed, so
    a refused command leaves the workdir as it was. Resume changes go to config_changes.jsonl
    with `step`, the checkpoint the run resumes from (the newest intact one)."""
    if jax.process_index() != 0:
        return
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    if not path.exists() or changes:
        workdir_lib.save_config(cfg, path)  # atomic: a kill mid-write keeps the old config
    if changes:
        line = json.dumps({"step": step, "changes": changes})
        workdir_lib.append_line(workdir / "config_changes.jsonl", line)
    for name, save in (
        ("tokenizer.json", data.tokenizer.save),
        ("compression.npz", data.compression.save),
    ):
        if not (workdir / name).exists():
            workdir_lib.write_via_local(workdir / name, save)
