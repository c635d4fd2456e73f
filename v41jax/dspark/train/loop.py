"""Several drafters trained against one frozen-target pass per step.

Against a deep target the frozen forward (hidden states of the layers the drafters read and
the target's logits over every position) costs several times a drafter's own forward and
backward, and it is the same for every drafter that shares the batch: the batch at step s is a
pure function of (seed, s) and the anchors too. `train_drafters` therefore computes it once per
step and hands it to each drafter's update, which is exactly what separate runs would compute:
each drafter's params, checkpoints and metrics equal those of `train_drafter` alone (tested).
Drafters that share a pass must agree on everything that fixes the batch (train.seed,
batch_size, anchors_per_seq, data_paths); each keeps its own workdir, so resume works per
drafter: a drafter that is further along skips the steps it has already taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from v41jax.data import BatchIterator, eval_batches, load_data
from v41jax.dspark.model.drafter import frozen_target
from v41jax.dspark.train import step as S
from v41jax.dspark.train.config import DrafterRunConfig, DrafterTrainConfig
from v41jax.dspark.train.load import load_drafter
from v41jax.dspark.train.objective import target_features
from v41jax.dspark.train.record import check_record, load_record, make_record, write_record
from v41jax.dspark.train.state import drafter_state_fns, restore_drafter_state
from v41jax.sharding import batch_shards
from v41jax.train import load_run
from v41jax.train.batches import add_engram_ids
from v41jax.train.run import Run
from v41jax.train.step import device_batch
from v41jax.train.steploop import Cadence, RunLog, run_steps
from v41jax.train.workdir_kind import require_kind
from v41jax.train.workdir_lock import workdir_lock


def batch_settings(t: DrafterTrainConfig) -> dict:
    """What fixes the batch and anchors (by `train.*` key): drafters sharing a target pass
    must agree on these."""
    keys = ("batch_size", "anchors_per_seq", "data_paths")
    return {"seed": t.loop.seed, **{k: getattr(t, k) for k in keys}}


@dataclasses.dataclass
class _DrafterRun:
    """One drafter's run: its config, workdir (`Run`: checkpoints, log, eval.json), state."""

    cfg: DrafterRunConfig
    workdir: str | os.PathLike  # as the caller named it: the key of its result
    run: Run
    state: dict
    update: object
    log: RunLog
    start: int
    result: dict
    data_state: dict | None
    cadence: Cadence

    def takes(self, step: int) -> bool:
        """Whether this run takes step `step` (1-based): resumed before it, not yet done."""
        return self.start < step <= self.cfg.train.loop.steps


def _check_shared(cfgs: dict[str, DrafterRunConfig], target_layers: int) -> tuple:
    first = next(iter(cfgs.values()))
    for workdir, cfg in cfgs.items():
        ours, theirs = batch_settings(cfg.train), batch_settings(first.train)
        for name, a in ours.items():
            if a != (b := theirs[name]):
                raise ValueError(
                    f"drafters sharing a target pass must agree on train.{name}: {workdir} has "
                    f"{a!r}, another {b!r}"
                )
    layers = sorted({i for c in cfgs.values() for i in c.drafter.layer_ids_for(target_layers)})
    return first.train, tuple(layers)


def _open_run(cfg, workdir, run: Run, target, record, resuming, init_from, frozen):
    """Open (or resume) one drafter's run (a `_DrafterRun`), its record checked; None when it
    has finished."""
    tcfg = target.cfg
    if not resuming or record["target_workdir"] != load_record(run)["target_workdir"]:
        write_record(run, record)  # a new run, or its target moved (identity checked)
    ckpt = run.checkpointer()
    start = ckpt.latest_step() or 0
    if start >= cfg.train.loop.steps and run.has("eval.json"):
        run.close()
        return None
    opt, new_state, shardings, abstract = drafter_state_fns(cfg, tcfg.model, frozen, target.mesh)
    update = S.make_update(cfg, tcfg.model, opt, shardings, target.mesh)
    data_state = None
    if start:  # the newest checkpoint that reads: a damaged one is named and set aside
        start, (state, data_state) = ckpt.restore_newest_intact(
            lambda s: restore_drafter_state(ckpt, s, abstract, cfg),
            set_aside=True,
            quiet=not run.writes,
        )
    elif init_from:
        state = new_state(load_drafter(init_from, target=target, check=False)[1])
    else:
        state = new_state(S.init_drafter_params(cfg, tcfg.model, frozen, cfg.train.loop.seed))
    # the cadence the trained steps ran under (a resume keeps drafter.json's settings: the
    # run's own) finds the train lines a damaged log lacks, as `train` does
    cadence = Cadence.of(cfg.train.loop)
    log = run.open_log(start, cadence=cadence)
    return _DrafterRun(
        cfg, workdir, run, state, update, log, start, {"step": start}, data_state, cadence
    )


def train_drafter(
    cfg: DrafterRunConfig,
    target_workdir: str | os.PathLike,
    workdir: str | os.PathLike,
    *,
    init_from: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict:
    """Train (or resume) the drafter in `workdir` against the target in `target_workdir`:
    `train_drafters` with this one drafter (one loop for one or many).

    Every check runs before the first write, so a refused command (missing target, other
    settings, bad layer ids) leaves `workdir` as it was (not even created)."""
    init = {workdir: init_from} if init_from else None
    return train_drafters({workdir: cfg}, target_workdir, init_from=init, progress=progress)[
        workdir
    ]


def train_drafters(
    cfgs: dict[str, DrafterRunConfig],
    target_workdir: str,
    *,
    init_from: dict[str, str] | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Train (or resume) every drafter `cfgs[workdir]` in its workdir against the target in
    `target_workdir`, one frozen-target pass per step for all of them. Returns {workdir:
    final evaluation} (`{"step": s, "stopped": True}` for runs stopped by a signal; a finished
    run returns its saved eval.json). Every check runs before the first write.

    First, from the folders' files alone (`v41jax.train.workdir_kind`): each drafter workdir
    is new, empty or a drafter run, the target a train run or an imported model, each
    `init_from` a drafter run. Then each drafter workdir's lock is taken
    (`v41jax.train.workdir_lock`: one writer per workdir) and held to the end; a refusal
    while holding them leaves the folders as they were."""
    if not cfgs:
        raise ValueError("no drafters to train")
    require_kind(target_workdir, "target")
    for workdir in cfgs:
        require_kind(workdir, "train-drafter")
    for source in (init_from or {}).values():
        require_kind(source, "drafter-init")
    with contextlib.ExitStack() as locks:
        for workdir in cfgs:
            locks.enter_context(workdir_lock(workdir, "train-drafter"))
        return _train_drafters_locked(cfgs, target_workdir, init_from or {}, progress)


def _train_drafters_locked(cfgs, target_workdir, init_from, progress) -> dict[str, dict]:
    """`train_drafters`' body, run while holding every drafter workdir's lock."""
    target = load_run(target_workdir)
    tcfg = target.cfg
    shared, layers = _check_shared(cfgs, tcfg.model.num_layers)
    frozen = frozen_target(target.params, tcfg.model)
    files = {w: Run(w, c.train.loop.keep_checkpoints) for w, c in cfgs.items()}
    records = {
        w: make_record(c, w, target, target_workdir, init_from.get(w)) for w, c in cfgs.items()
    }
    resuming = {w: check_record(files[w], r) for w, r in records.items()}  # all before any write
    results, runs = {}, []
    for workdir, cfg in cfgs.items():
        run = _open_run(
            cfg,
            workdir,
            files[workdir],
            target,
            records[workdir],
            resuming[workdir],
            init_from.get(workdir),
            frozen,
        )
        if run is None:
            results[workdir] = files[workdir].read_eval()
        else:
            runs.append(run)
    if not runs:
        return results
    data_cfg = tcfg.data
    if shared.data_paths:  # other text (e.g. the target's own samples), not its token dir
        data_cfg = dataclasses.replace(data_cfg, paths=tuple(shared.data_paths), token_dir="")
    data = load_data(data_cfg, show_progress=progress, tokenizer=target.tokenizer)
    seq_len, mesh = tcfg.data.seq_len, target.mesh
    if shared.batch_size % batch_shards(mesh):
        raise ValueError(
            f"train.batch_size={shared.batch_size} is not divisible by the target mesh's "
            f"data x fsdp = {batch_shards(mesh)} batch shards"
        )
    pi, pc = jax.process_index(), jax.process_count()
    it = BatchIterator(
        data.train_tokens, data.train_segments, seq_len, shared.batch_size, shared.loop.seed, pi, pc
    )
    rows = slice(pi * it.per_process_batch_size, (pi + 1) * it.per_process_batch_size)
    for r in runs:
        if r.data_state is not None:
            it.restore(r.data_state)  # refuses data that changed under a resumed run
    prepare = lambda b: device_batch(mesh, add_engram_ids(b, data.compression, tcfg.model))
    val_sets: dict[int, list] = {}
    for n in {r.cfg.train.loop.eval_batches for r in runs}:  # too little held-out text fails now,
        raw = eval_batches(
            data.val_tokens, data.val_segments, seq_len, shared.batch_size, n, pi, pc
        )
        val_sets[n] = [prepare(b) for b in raw]  # not after the last step

    def evaluate(r: _DrafterRun) -> dict:
        ids = r.cfg.drafter.layer_ids_for(tcfg.model.num_layers)
        val = val_sets[r.cfg.train.loop.eval_batches]
        return S.evaluate_drafter(r.cfg, target, frozen, r.state["params"], val, ids)

    target_params = nn.unbox(target.params)
    features = jax.jit(functools.partial(target_features, target_cfg=tcfg.model, layer_ids=layers))
    start, end = min(r.start for r in runs), max(r.cfg.train.loop.steps for r in runs)
    n, t0 = shared.anchors_per_seq, time.perf_counter()

    def body(done: int, bar) -> None:  # step `done` (1-based): batch and anchors of done - 1
        todo = [r for r in runs if r.takes(done)]
        if not todo:  # every run is further along (resumed at different steps)
            return
        # the anchors of this process's rows, sharded like the batch
        anchors = S.anchors_at(shared.loop.seed, done - 1, shared.batch_size, seq_len, n)[rows]
        batch = prepare({**it.batch_at(done - 1), "anchors": anchors.astype(np.int32)})
        anchors = batch.pop("anchors")
        feats, logits = features(target_params, batch=batch)
        it.step = done
        for r in todo:
            mine = _select(feats, layers, r.cfg.drafter.layer_ids_for(tcfg.model.num_layers))
            r.state, metrics = r.update(r.state, frozen, mine, logits, batch, anchors)
            if r.cadence.logs(done):
                rec = {"step": done, **S.flat_metrics(metrics), "wall_s": time.perf_counter() - t0}
                r.log(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['accept_1']:.2f}")
            if r.cadence.evaluates(done):
                r.result = {"step": done, **evaluate(r)}
                r.log(r.result)
            if r.cadence.saves(done):
                r.run.checkpointer().save(done, r.state, it.state())

    def on_stop(done: int) -> None:  # every run that took this step saves it
        for r in runs:
            if r.takes(done):
                r.run.checkpointer().save(done, r.state, it.state())
            if max(done, r.start) < r.cfg.train.loop.steps:  # not finished: no eval.json
                r.result = {"step": max(done, r.start), "stopped": True}

    if run_steps(start, end, body, on_stop, desc="drafters", progress=progress) is None:
        for r in runs:  # killed after its last checkpoint, before its eval.json
            if r.start == r.cfg.train.loop.steps:
                r.result = {"step": r.start, **evaluate(r)}
    for r in runs:
        r.run.close()  # the checkpoints are on disk before eval.json says done
        if not r.result.get("stopped"):
            r.run.write_eval(r.result)
        results[r.workdir] = r.result
    return results


def _select(feats_BxTxF, layers: tuple[int, ...], mine: tuple[int, ...]):
    """A drafter's features (its layers in its order) from the shared pass over `layers`."""
    if tuple(mine) == layers:
        return feats_BxTxF
    d = feats_BxTxF.shape[-1] // len(layers)
    chunks = [feats_BxTxF[..., layers.index(i) * d : (layers.index(i) + 1) * d] for i in mine]
    return jnp.concatenate(chunks, axis=-1)
