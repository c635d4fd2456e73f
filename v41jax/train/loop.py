"""The training loop: resumable, checkpointed, logged; plus evaluation and run loading.

WORKDIR layout
    config.json        the run's full config: `train --workdir W` resumes from it; a rerun
                       may change only what leaves the trained steps as they were
                       (`v41jax.train.resume`: e.g. raise train.steps)
    config_changes.jsonl  what each such rerun changed, at which step
    tokenizer.json     the BPE tokenizer the run trained on (generation needs no cache)
    compression.npz    tokenizer compression table (original id -> canonical id)
    checkpoints/<step> orbax checkpoints: train state + data-iterator state
    metrics.jsonl      one JSON object per line: train steps and evals
    eval.json          the final evaluation

WORKDIR is a local path or any URL etils.epath and orbax support (gs://bucket/run): every
read and write of it goes through epath (`v41jax.train.workdir`). A stop on SIGTERM is agreed
by every process of the job (`v41jax.train.preemption`).

Exact resume: the batch at step s is a pure function of (data seed, s), the step's randomness
is `fold_in(state.rng, s)`, and a checkpoint holds the exact fp32 state, so a run killed at any
point and restarted with the same command retraces the uninterrupted run step for step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import numpy as np

from v41jax import config as config_lib
from v41jax.config import Config
from v41jax.data import BatchIterator, PreparedData, eval_batches, load_data
from v41jax.engram.training import table_strategy
from v41jax.model import convert_layout, layer_segments
from v41jax.model.attach import attach_new_modules
from v41jax.model.host_params import host_table_arrays
from v41jax.sharding import batch_shards, make_mesh
from v41jax.train import run_files
from v41jax.train.batches import PrefetchingBatches, add_engram_ids
from v41jax.train.observe import Profiler, flops_metrics
from v41jax.train.resume import (
    COMPUTE_ONLY_MODEL_FIELDS,
    latest_checkpoint_step,
    reconcile,
    saved_config,
)
from v41jax.train.run import Run
from v41jax.train.run_files import write_run_files
from v41jax.train.runs import LoadedRun, load_run
from v41jax.train.state import describe_optimizer, init_table_arrays, make_state_fns
from v41jax.train.step import device_batch, make_eval_step, make_train_step
from v41jax.train.steploop import Cadence, run_steps
from v41jax.train.workdir import as_path, check_local_features
from v41jax.train.workdir_kind import require_kind
from v41jax.train.workdir_lock import workdir_lock


def maybe_initialize_distributed() -> None:
    """Join a multi-process job when launched as one (scripts/launch_*.sh set the variables).

    V41JAX_DISTRIBUTED=1 turns it on. The coordinator comes from JAX_COORDINATOR_ADDRESS; the
    process count and id from V41JAX_NUM_PROCESSES / V41JAX_PROCESS_ID when set, otherwise from
    the cluster (TPU pod metadata, SLURM, Open MPI), which JAX detects itself.
    """
    if os.environ.get("V41JAX_DISTRIBUTED") != "1" or jax.distributed.is_initialized():
        return
    kwargs = {}
    if "V41JAX_NUM_PROCESSES" in os.environ:
        kwargs["num_processes"] = int(os.environ["V41JAX_NUM_PROCESSES"])
    if "V41JAX_PROCESS_ID" in os.environ:
        kwargs["process_id"] = int(os.environ["V41JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)


def enable_compilation_cache(cfg: Config) -> str | None:
    """Turn on JAX's persistent compilation cache for this process (a rerun, or a second run
    of the same shapes, then skips XLA compilation): JAX's own setting
    (JAX_COMPILATION_CACHE_DIR) wins, V41JAX_COMPILATION_CACHE=off or train.compilation_cache
    "" leave it off. It must be set before the process's first compilation to take effect.
    Returns the directory in use, or None."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = cfg.train.compilation_cache
    if not path or os.environ.get("V41JAX_COMPILATION_CACHE") == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    return jax.config.jax_compilation_cache_dir


def resolve_data_dependent(cfg: Config, data: PreparedData) -> Config:
    """Fill what only the data knows: Engram's compressed vocabulary size V'."""
    engram = cfg.model.engram
    v_prime = data.compression.compressed_vocab_size
    if not engram.enabled:
        return cfg
    if engram.compressed_vocab_size not in (0, v_prime):
        raise ValueError(
            f"model.engram.compressed_vocab_size={engram.compressed_vocab_size} but the "
            f"tokenizer's compression table has V'={v_prime}; leave it 0 to take it from the data"
        )
    engram = dataclasses.replace(engram, compressed_vocab_size=v_prime)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engram=engram))


def validation_batches(cfg: Config, data: PreparedData, num_batches: int) -> list[dict]:
    """The first `num_batches` validation batches of this process, Engram ids included."""
    try:
        batches = eval_batches(
            data.val_tokens,
            data.val_segments,
            cfg.data.seq_len,
            cfg.data.global_batch_size,
            num_batches,
            jax.process_index(),
            jax.process_count(),
        )
    except ValueError as e:  # name the setting to change, not just the arithmetic
        raise ValueError(
            f"train.eval_batches={num_batches}: {e} (lower train.eval_batches, or raise "
            f"data.val_fraction={cfg.data.val_fraction} or give more text)"
        ) from None
    return [add_engram_ids(b, data.compression, cfg.model) for b in batches]


def evaluate(eval_step, mesh, params, batches: list[dict]) -> dict:
    """Token-weighted validation loss over `batches`, and eval tokens/s (timed after the first
    batch, which pays for compilation)."""
    loss_sum, tokens, timed_tokens = 0.0, 0.0, 0.0
    start = time.perf_counter()
    for i, b in enumerate(batches):
        out = jax.device_get(eval_step(params, device_batch(mesh, b)))
        loss_sum += float(out["loss_sum"])
        tokens += float(out["tokens"])
        if i == 0:
            start = time.perf_counter()
        else:
            timed_tokens += float(out["tokens"])
    seconds = time.perf_counter() - start
    result = {"val_loss": loss_sum / tokens, "val_tokens": tokens}
    if timed_tokens:
        result["eval_tokens_per_s"] = timed_tokens / seconds
    return result


def _with_saved_vocab(cfg: Config, saved: Config) -> Config:
    """`cfg` with the saved run's data-derived V' where `cfg` leaves it to the data (0)."""
    engram = cfg.model.engram
    if engram.compressed_vocab_size or not engram.enabled:
        return cfg
    engram = dataclasses.replace(
        engram, compressed_vocab_size=saved.model.engram.compressed_vocab_size
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engram=engram))


def _init_source(cfg: Config) -> LoadedRun:
    """The run train.init_from names, checked against the new run's model."""
    outside = table_strategy(cfg).outside_params  # the new run keeps its tables outside
    source = load_run(cfg.train.init_from, tables="host" if outside else "device")
    # How the params are computed with (scan, remat, attention path) may differ; the params
    # themselves may not, except for their layer layout, which is converted.
    free = {k: getattr(cfg.model, k) for k in COMPUTE_ONLY_MODEL_FIELDS}
    # Engram and mHC may be attached to a source without them (`attach_new_modules`)
    if not source.cfg.model.engram.enabled:
        free["engram"] = cfg.model.engram
    if not source.cfg.model.mhc.enabled:
        free["mhc"] = cfg.model.mhc
    source_model = dataclasses.replace(source.cfg.model, **free)
    if diffs := config_lib.diff(source_model, cfg.model):
        raise ValueError(f"train.init_from={cfg.train.init_from}: model differs {diffs}")
    return source


def train(
    cfg: Config, workdir: str | os.PathLike, *, progress: bool = True, role: str = "train"
) -> dict:
    """Train (or resume) the run in `workdir` (a local path, or any URL `etils.epath` and
    orbax support, e.g. gs://bucket/run: `v41jax.train.workdir`); returns the final
    evaluation.

    `workdir` must be new, empty or a train run: any other kind of folder (a drafter run, an
    imported model, a sweep's runs, token files, ...) is refused by name before anything is
    read or written (`v41jax.train.workdir_kind`). An imported model is fine-tuned into a
    new workdir with train.init_from, not trained in place. role="sweep-cell" (the sweep's
    cells) also takes a run a sweep finished. One writer per workdir: its lock
    (`v41jax.train.workdir_lock`) is held from before the first write to the end, released
    on any exception, and a refusal while holding it leaves the folder as it was."""
    maybe_initialize_distributed()
    require_kind(workdir, role)
    if cfg.train.init_from:
        require_kind(cfg.train.init_from, "init-from")
    with workdir_lock(workdir, "sweep" if role == "sweep-cell" else role):
        return _train_locked(cfg, workdir, progress=progress)


def _train_locked(cfg: Config, workdir: str | os.PathLike, *, progress: bool) -> dict:
    """`train`'s body, run while holding the workdir's lock."""
    maybe_initialize_distributed()
    enable_compilation_cache(cfg)
    main = jax.process_index() == 0
    workdir = as_path(workdir)
    check_local_features(cfg, workdir)  # before the workdir is first read
    saved, latest = saved_config(workdir), latest_checkpoint_step(workdir)
    source = cfg.train.init_from
    if source and not (as_path(source) / "config.json").exists():
        raise FileNotFoundError(f"train.init_from={source} holds no run (no config.json)")
    if saved is not None:  # refuse a different run at once, before preparing any data
        reconcile(saved, _with_saved_vocab(cfg, saved), latest, workdir)
    data = run_files.prepare(cfg, workdir, progress and main)
    cfg = resolve_data_dependent(cfg, data)
    changes: list[str] = []
    if saved is not None:
        cfg, changes = reconcile(saved, cfg, latest, workdir)
    # Every check before the first write: a refused command leaves the workdir untouched.
    mesh = make_mesh(cfg.mesh)
    shards = batch_shards(mesh)
    if (cfg.data.global_batch_size // cfg.train.microbatches) % shards:
        raise ValueError(
            f"data.global_batch_size={cfg.data.global_batch_size} / train.microbatches="
            f"{cfg.train.microbatches} is not divisible by the mesh's data x fsdp = {shards} "
            "batch shards"
        )
    model, optimizer, init_fn, shardings, abstract = make_state_fns(cfg, mesh)
    val = validation_batches(cfg, data, cfg.train.eval_batches)
    source = _init_source(cfg) if latest is None and source else None
    iterator = BatchIterator(
        data.train_tokens,
        data.train_segments,
        cfg.data.seq_len,
        cfg.data.global_batch_size,
        cfg.data.seed,
        jax.process_index(),
        jax.process_count(),
        data_sha256=data.train_sha256,  # a token dir's, from its manifest: nothing is read
    )
    run = Run(workdir, cfg.train.keep_checkpoints, asynchronous=cfg.train.async_checkpoints)
    checkpointer = run.checkpointer() if latest is not None else None
    # where the Engram tables live (`v41jax.engram.training`): chosen once, driven from here
    tables = table_strategy(cfg)
    init_tables = functools.partial(init_table_arrays, cfg)
    resumed, source_tables = None, None
    if checkpointer is not None:  # the newest checkpoint that reads (a damaged one is named
        # and set aside), restored before the run's files are written: config_changes.jsonl
        # names the step resumed from, and a refused restore leaves the workdir's files as
        # they were

        def restore(step: int) -> tuple:  # the tables from the same step as the state
            state, extra = checkpointer.restore(step, abstract)
            tables.open(checkpointer, step, os.fspath(workdir), init_tables)
            return state, extra

        resumed = checkpointer.restore_newest_intact(restore, set_aside=True, quiet=not main)
        if resumed is not None:
            iterator.restore(resumed[1][1]["iterator"])  # refuses data changed under the run
    write_run_files(cfg, workdir, data, changes, None if resumed is None else resumed[0])
    if resumed is not None:
        start, (state, _) = resumed
        if main:
            if changes:
                print(f"resuming {workdir} at step {start} with changes: {'; '.join(changes)}")
            print(f"resumed from {checkpointer.directory}/{start}")
    else:
        checkpointer = checkpointer or run.checkpointer()
        start, state = 0, init_fn(cfg.train.seed)
        if source is not None:  # fine-tuning: another run's params, a fresh optimizer
            params = convert_layout(source.params, layer_segments(cfg.model))
            src_model = source.cfg.model
            if (cfg.model.engram.enabled and not src_model.engram.enabled) or (
                cfg.model.mhc.enabled and not src_model.mhc.enabled
            ):  # new Engram / mHC modules, started at the source's function
                params = attach_new_modules(params, state.params)
            if tables.outside_params:  # the source's tables stay outside the params
                source_tables = host_table_arrays(params)
                params = tables.state_params(params)
            state = state.replace(params=jax.device_put(params, shardings.params))
    if iterator.step != start or int(state.step) != start:
        raise RuntimeError(
            f"checkpoint {start} is inconsistent: iterator step {iterator.step}, "
            f"state step {int(state.step)}"
        )
    groups = describe_optimizer(cfg, abstract.params)
    run.write_json("optimizer.json", {"recipe": cfg.optim.recipe, "groups": groups})
    if main:
        for g in groups:
            print(
                f"optimizer group {g['group']}: {g['rule']}, peak lr {g['peak_lr']:.3g} "
                f"({g['scaling']}), weight decay {g['weight_decay']:g}"
            )
    train_step = make_train_step(cfg, mesh, model, optimizer, shardings)
    eval_step = make_eval_step(cfg, mesh, model, shardings.params)
    add_ids = functools.partial(add_engram_ids, compression=data.compression, cfg=cfg.model)
    if resumed is None:  # a new run (a resumed one opened them with its state)
        tables.open(checkpointer, start, os.fspath(workdir), init_tables, source_tables)
    to_device = functools.partial(device_batch, mesh)
    step_fn = functools.partial(tables.step, train_step, to_device)
    batches = PrefetchingBatches(iterator, lambda b: tables.prepare_batch(add_ids(b)))
    # the trained steps' cadence (config.json as it was) finds train lines the log lacks
    trained = Cadence.of((saved or cfg).train)
    log = run.open_log(start, tensorboard=cfg.train.tensorboard, cadence=trained)
    profiler = Profiler(cfg.train.profile_steps if main else "", workdir / "profile")
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    cadence, steps = Cadence.of(cfg.train), cfg.train.steps
    clock = {"time": time.perf_counter(), "step": start}  # of the last log line
    result: dict = {}

    def save(step: int) -> None:
        saved_tables = tables.checkpoint(step)
        checkpointer.save(step, state, {"iterator": iterator.state()}, saved_tables)

    def validation() -> list[dict]:  # with the tables as they are now
        return [tables.eval_batch(b) for b in val]

    def body(step: int, bar) -> None:
        nonlocal state, result
        profiler.before(step)
        state, metrics = step_fn(state, next(batches))
        profiler.after(step, state)
        if cadence.logs(step):
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not np.isfinite(metrics["loss"]):
                raise FloatingPointError(
                    f"loss is {metrics['loss']} at step {step}; last checkpoint: "
                    f"{checkpointer.latest_step()} (not overwritten)"
                )
            now = time.perf_counter()
            tps = (step - clock["step"]) * tokens_per_step / (now - clock["time"])
            clock.update(time=now, step=step)
            log({"step": step, **metrics, "tokens_per_s": tps, **flops_metrics(cfg, tps)})
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tps:,.0f}")
        if cadence.saves(step):
            save(step)
        if cadence.evaluates(step):
            result = {"step": step, **evaluate(eval_step, mesh, state.params, validation())}
            log(result)
            bar.write(f"step {step}: val_loss {result['val_loss']:.4f}")

    def on_stop(step: int) -> None:
        save(step)
        checkpointer.wait()

    stopped = run_steps(
        start,
        steps,
        body,
        on_stop,
        desc=f"train {cfg.name}",
        progress=progress and main,
        stop_check_every=cfg.train.stop_check_every,
    )
    if stopped is not None:
        result = {"step": stopped, "stopped": True}
    if start == steps:  # nothing left to train: report the saved model
        result = {"step": steps, **evaluate(eval_step, mesh, state.params, validation())}
    checkpointer.wait()  # the final checkpoint is on disk before eval.json says done
    if not result.get("stopped"):
        run.write_eval(result)  # process 0, atomically
    batches.close()
    run.close()  # the checkpointer and the log
    profiler.close()
    return result


def evaluate_run(
    workdir: str | os.PathLike, num_batches: int | None = None, progress: bool = False
) -> dict:
    """Validation loss of the newest intact checkpoint in `workdir`, and its "step" (a
    damaged newer one is named on stderr and left as it is: `load_run`)."""
    run = load_run(workdir)
    data = load_data(run.cfg.data, show_progress=progress, tokenizer=run.tokenizer)
    eval_step = make_eval_step(run.cfg, run.mesh, run.model, run.param_shardings)
    val = validation_batches(run.cfg, data, num_batches or run.cfg.train.eval_batches)
    return {"step": run.step, **evaluate(eval_step, run.mesh, run.params, val)}
