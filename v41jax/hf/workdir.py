"""`python -m v41jax import-hf DIR --workdir W` and `export-hf`: a Hugging Face model
directory as a v41jax workdir, and back.

The workdir holds what a trained run's does (`v41jax.train.loop`): config.json (the mapped
model; data, train and the rest from `base` with `--set` overrides), tokenizer.json (+ the
tokenizer_config.json naming its eos), compression.npz and checkpoints/0 with the params
and a fresh optimizer state, so `eval`, `generate`, `train-drafter` and fine-tuning
(`--set train.init_from=W`) take it as they take a run's. The params are read tensor by
tensor straight into the shardings of the config's mesh (`load_hf_params`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp

from v41jax import config as config_lib
from v41jax.config import Config
from v41jax.data import Tokenizer, build_compression_table
from v41jax.hf.checkpoint import check_hf_dir, load_hf_params, read_hf_config, save_hf
from v41jax.hf.convert import model_config_from_hf
from v41jax.sharding import make_mesh
from v41jax.train import load_run
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.state import TrainState, make_state_fns
from v41jax.train.workdir import as_path, save_config, write_via_local
from v41jax.train.workdir_kind import require_kind

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def imported_config(
    hf_dir: str, base: str = "small", overrides: list[str] = (), tok: Tokenizer | None = None
) -> Config:
    """The run config of an HF model: `base`'s data/train/optim settings, the model from
    config.json, data.vocab_size from the tokenizer (`tok`, default the directory's), then
    `overrides` (`--set`)."""
    model = model_config_from_hf(read_hf_config(hf_dir))
    tok = tok or load_hf_tokenizer(hf_dir)
    if tok.vocab_size > model.vocab_size:
        raise ValueError(
            f"{hf_dir}: tokenizer.json has {tok.vocab_size} tokens, more than the model's "
            f"vocab_size={model.vocab_size}"
        )
    cfg = config_lib.get_config(base)
    data = dataclasses.replace(cfg.data, vocab_size=tok.vocab_size)
    name = os.path.basename(os.path.normpath(hf_dir))
    cfg = dataclasses.replace(cfg, name=name, model=model, data=data)
    return config_lib.override(cfg, list(overrides)) if overrides else cfg


def load_hf_tokenizer(hf_dir: str) -> Tokenizer:
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{hf_dir} has no tokenizer.json (a tokenizers file is needed)")
    return Tokenizer.load(path)


def import_hf(hf_dir: str, workdir: str, base: str = "small", overrides: list[str] = ()) -> dict:
    """Write the v41jax workdir of the HF model in `hf_dir`; returns a summary. `workdir`
    must be new or empty (`v41jax.train.workdir_kind`: a run, a drafter run or any other
    folder is refused by name before anything is read; nothing is overwritten), and `hf_dir`
    a readable HF model directory (`check_hf_dir`: a missing or damaged one is named). The import
    is recognised later by its checkpoint 0, whose "data" item records `imported_from`."""
    require_kind(workdir, "import-hf")
    check_hf_dir(hf_dir)  # missing or damaged files named before the tokenizer is read
    out = as_path(workdir)
    tok = load_hf_tokenizer(hf_dir)
    cfg = imported_config(hf_dir, base, overrides, tok)
    mesh = make_mesh(cfg.mesh)
    _, optimizer, _, shardings, _ = make_state_fns(cfg, mesh)
    params = load_hf_params(hf_dir, cfg.model, shardings.params)  # every check before writing
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
        params=params,
        opt_state=opt_state,
        rng=jax.device_put(
            jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), 1), shardings.rng
        ),
    )
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.json")
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(hf_dir, name)):
            src = os.path.join(hf_dir, name)
            write_via_local(out / name, lambda tmp, src=src: shutil.copyfile(src, tmp))
    write_via_local(out / "compression.npz", build_compression_table(tok).save)
    ckpt = Checkpointer(out / "checkpoints", cfg.train.keep_checkpoints)
    ckpt.save(0, state, {"imported_from": os.path.abspath(hf_dir)})
    ckpt.close()
    n = sum(x.size for x in jax.tree.leaves(params))
    return {
        "workdir": os.fspath(out),
        "family": read_hf_config(hf_dir)["model_type"],
        "parameters": int(n),
        "vocab_size": cfg.model.vocab_size,
        "tokenizer_vocab": tok.vocab_size,
        "eos_id": tok.eos_id,
    }


def export_hf(workdir: str, out_dir: str, family: str, step: int | None = None) -> list[str]:
    """Write the run in `workdir` (latest or `step` checkpoint) as an HF `family` model
    directory, its tokenizer files beside; returns the files written. `out_dir` must be new
    or empty and `workdir` a train run or an imported model (`v41jax.train.workdir_kind`),
    checked before anything is loaded."""
    require_kind(workdir, "export-source")
    require_kind(out_dir, "export-hf")
    run = load_run(workdir, step, tables="device")
    files = save_hf(run.params, run.cfg.model, family, out_dir)
    for name in TOKENIZER_FILES:
        src = as_path(workdir) / name
        if src.exists():
            (as_path(out_dir) / name).write_bytes(src.read_bytes())
            files.append(name)
    with open(os.path.join(out_dir, "v41jax_export.json"), "w") as f:
        json.dump({"workdir": os.path.abspath(workdir), "step": run.step}, f, indent=2)
    return [*files, "v41jax_export.json"]
