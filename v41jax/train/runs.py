"""A trained run read back for evaluation and decoding: `load_run(workdir)` -> `LoadedRun`.

The run's config, tokenizer, compression table and the params of one checkpoint, with its
Engram tables on the device or kept in host memory or in their files (`tables=`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from v41jax.config import Config
from v41jax.data import CompressionTable, Tokenizer
from v41jax.engram.host_rows import HostRows
from v41jax.engram.training import table_strategy
from v41jax.engram.training.sparse import merge_tables
from v41jax.model.host_params import tables_on_host
from v41jax.sharding import make_mesh
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.run_files import load_compression, load_tokenizer
from v41jax.train.state import make_state_fns
from v41jax.train.workdir import as_path, is_local, load_config


@dataclasses.dataclass
class LoadedRun:
    cfg: Config
    tokenizer: Tokenizer
    compression: CompressionTable
    params: object
    step: int
    mesh: object
    model: object
    param_shardings: object


def load_run(
    workdir: str | os.PathLike, step: int | None = None, tables: str = "auto"
) -> LoadedRun:
    """The config, tokenizer and params of a trained run: checkpoint `step`, or by default
    the newest one that reads (a damaged newer one is named on stderr and left in place:
    `LoadedRun.step` says which step this is).

    tables: where the Engram tables go for evaluation and decoding: "device" (params),
    "host" (host memory, read through `HostRows` callbacks: `v41jax.model.host_params`), or
    "auto" (host for a run trained with `model.engram.table_placement=host`, else device).
    The returned cfg says placement "device" either way: it is the decoding config, whose
    params hold the tables (as arrays or as `HostRows`).

    workdir: a local path or any URL `etils.epath` and orbax read (gs://bucket/run)."""
    if tables not in ("auto", "device", "host"):
        raise ValueError(f"load_run: tables={tables!r} must be 'auto', 'device' or 'host'")
    workdir = as_path(workdir)
    path = workdir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{workdir} holds no run (no config.json); train one first")
    cfg = load_config(path)
    tokenizer = load_tokenizer(workdir)
    compression = load_compression(workdir)
    # an imported model's embedding may have more rows than its tokenizer has tokens (Qwen
    # pads them), never fewer; v41jax's own runs have them equal (data.vocab_size)
    if tokenizer.vocab_size != cfg.data.vocab_size or tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"{workdir}: tokenizer.json has {tokenizer.vocab_size} tokens but the run's "
            f"data.vocab_size={cfg.data.vocab_size}, model.vocab_size={cfg.model.vocab_size}; "
            "the workdir's files are inconsistent"
        )
    mesh = make_mesh(cfg.mesh)
    model, _, _, shardings, abstract = make_state_fns(cfg, mesh)
    checkpointer = Checkpointer(workdir / "checkpoints", cfg.train.keep_checkpoints)
    have = checkpointer.all_steps()
    if step is not None and step not in have:
        raise FileNotFoundError(
            f"no checkpoint of step {step} in {checkpointer.directory} (have {have})"
        )
    placement = table_strategy(cfg)  # where the run kept its Engram tables while training
    outside = placement.outside_params
    placement.check_workdir(workdir, is_local(workdir))

    def restore(s: int) -> tuple:  # the params and the tables kept outside them, of step s
        state, _ = checkpointer.restore(s, abstract)
        return state.params, placement.decoding_tables(checkpointer, s, os.fspath(workdir))

    # read-only: a damaged newest step is named and left in place (`train` sets it aside)
    found = checkpointer.restore_newest_intact(
        restore,
        set_aside=False,
        steps=None if step is None else [step],
        quiet=jax.process_index() != 0,
    )
    if found is None:
        raise FileNotFoundError(f"no checkpoints in {checkpointer.directory}: train the run first")
    step, (params, host) = found
    on_host = tables == "host" or (tables == "auto" and outside)
    if outside:  # evaluation and decoding read the tables as params
        cfg = placement.decoding_config(cfg)
        model, _, _, shardings, _ = make_state_fns(cfg, mesh)
        if on_host:
            params = tables_on_host(params, cfg.model, host)
        else:
            tables_ = {
                (f"block_{k}", "engram", "table"): HostRows(t).read(np.arange(t.num_rows))
                for k, t in host.items()
            }
            params = jax.device_put(merge_tables(params, tables_), shardings.params)
    elif on_host and cfg.model.engram.enabled:
        params = tables_on_host(params, cfg.model)  # copied to host memory, off the device
    param_shardings = shardings.params
    if on_host and cfg.model.engram.enabled:  # the same HostRows in both trees
        refs = {k: params[f"block_{k}"]["engram"]["table"] for k in cfg.model.engram.layer_ids}
        param_shardings = tables_on_host(param_shardings, cfg.model, refs)
    checkpointer.close()
    return LoadedRun(cfg, tokenizer, compression, params, step, mesh, model, param_shardings)
