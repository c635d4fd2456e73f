"""Frozen-backbone drafter training (`python -m v41jax train-drafter --target-workdir T ...`).

WORKDIR layout (resumable like `train`: the same command continues a killed run; written
through `v41jax.train.run.Run` as `train` writes its own: epath paths, so gs:// works,
process 0 writes the small files, each atomically)
    drafter.json       DrafterRunConfig + the target it was trained against: its path
                       (relative to this workdir), step and `run_identity` hash, which every
                       later use checks (a rerun must match; a moved target may be named)
    checkpoints/<step> orbax: {params, opt_state} of the drafter only + data-iterator state
    metrics.jsonl      train steps and evals (loss, ce, conf_bce, accept_k, conf_k per position)
    tensorboard/       the same records as TensorBoard scalars
    eval.json          the final evaluation

Modules
    config     DrafterTrainConfig, DrafterRunConfig (drafter.json's "config"), overrides
    record     drafter.json: writing, the resume check, the target check
    objective  the loss and evaluation metrics on a frozen-target pass
    state      the train state {params, opt_state}: optimizer, shardings, legacy restore
    step       initial params, the jitted update, anchors, evaluation
    loop       train_drafter / train_drafters: one frozen-target pass per step for all
    load       load_drafter: a trained drafter's params for decoding (no optimizer)
    replay     width policies priced on logged decode rounds

The optimizer, its schedule, the state's creation and the step loop are the training
stack's (`v41jax.train.optimizer`, `v41jax.train.steploop`): the state lives on the
target's mesh in the shardings of its logical annotations, each batch is split over the
mesh's data x fsdp axes (train.batch_size must divide), each process reads only its rows,
and a stop on SIGTERM is agreed by every process (`v41jax.train.preemption`).

Realignment: `--target-workdir` may name a target trained further than the one the drafter
started from (`--init-from` a previous drafter workdir): the drafter keeps training against
the new target, with no gradient into it.
"""
