"""A trained drafter read back for decoding: `load_drafter(workdir)` -> (config, params, record).

Decoding needs the drafter's params and nothing else of its train state: they are restored
alone (`Run.restore_params`, an orbax partial restore of the checkpoint's "params"
subtree), so no optimizer is built and no optimizer state is read, whatever structure the
checkpoint's optimizer state has (today's or the earlier chain(clip, adamw) one). Training
resumes the whole state (`v41jax.dspark.train.state.restore_drafter_state`).
"""

from __future__ import annotations

import os

import jax

from v41jax.dspark.model.drafter import frozen_target
from v41jax.dspark.train.record import check_target, load_drafter_config, recorded_target
from v41jax.dspark.train.state import abstract_drafter_params
from v41jax.train import load_run
from v41jax.train.run import Run


def load_drafter(
    workdir: str | os.PathLike, step: int | None = None, *, target=None, check: bool = True
):
    """(DrafterRunConfig, drafter params, record) of checkpoint `step`, or by default the
    newest one that reads (as `load_run`: a damaged newer one is named on stderr and left in
    place; record["step"] says which step this is). A damaged `step` asked for by number is
    a `DamagedCheckpointError` naming it.

    target: the target run (a LoadedRun) to use it with; default the one the run records.
    It must be the model the drafter was trained for (`check_target`): its shapes define the
    drafter's, and its mesh the params' shardings."""
    cfg, record = load_drafter_config(workdir)
    if target is None:
        target = load_run(recorded_target(workdir, record))
    if check:
        check_target(workdir, record, target)
    frozen = frozen_target(target.params, target.cfg.model)
    abstract = abstract_drafter_params(cfg, target.cfg.model, frozen, target.mesh)
    run = Run(workdir, cfg.train.loop.keep_checkpoints)
    ckpt = run.checkpointer()
    try:  # read-only, as `load_run`: a damaged newest step is named and left in place
        if step is not None and step not in (have := ckpt.all_steps()):
            raise FileNotFoundError(
                f"no drafter checkpoint of step {step} in {ckpt.directory} (have {have})"
            )
        found = ckpt.restore_newest_intact(
            lambda s: run.restore_params(s, abstract),
            set_aside=False,
            steps=None if step is None else [step],
            quiet=jax.process_index() != 0,
        )
    finally:
        run.close()
    if found is None:
        raise FileNotFoundError(
            f"no drafter checkpoints in {ckpt.directory}: train the drafter first"
        )
    step, params = found
    return cfg, params, {**record, "step": step}
