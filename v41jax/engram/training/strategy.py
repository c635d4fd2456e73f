"""Where Engram tables live while a run trains: the `TableStrategy` interface.

One strategy is chosen per run from its config (`v41jax.engram.training.table_strategy`):

    placement  chosen by                                   module
    device     table_optimizer "adam"                      `device`: tables are params (optax)
    sparse     table_optimizer sparse_adam / rowwise_adagrad  `sparse`: params, row updates
    host       + table_placement "host"                    `host`: numpy arrays in host RAM
    file       + table_path                                `files`: memory-mapped table files

The trainer (`v41jax.train`) owns the model, the optimizer, the jitted step and the transfer
of batches to the devices; it DRIVES the strategy, handing it those as values and callables,
so Engram never imports the trainer. Every method has a do-nothing answer (`device`'s), so a
trainer calls them all unconditionally. The methods, in the order a run calls them:

  building the train state (`make_state_fns`)
    state_params(params)          -> the params tree the TrainState holds
    optax_config(optim_cfg)       -> the optimizer config optax is built from
    optax_params(params)          -> the params optax covers
    init_opt_state(optimizer, params) -> TrainState.opt_state
    opt_state_shardings(state_shardings) -> state_shardings with the table states' own

  building the step (`make_train_step`)
    train_step(dense_step, forward_loss, optimizer, schedule, module_norms) -> step fn
    step_out_shardings(out_shardings, replicated) -> the step's out_shardings
    finish_step(outputs)          -> the jitted step's outputs after any work of its own
                                  (run by the step `make_train_step` returns)
    batch_shardings(shardings, replicated)        -> the batch's in_shardings

  running (`train`): state outside the TrainState, checkpointed with it
    open(checkpointer, step, workdir, init_tables, source_tables=None)
                                  make the tables of `step` (restored, or new at step 0)
    prepare_batch(batch)          -> the batch as the step reads it (prefetch thread)
    step(train_step, to_device, state, batch) -> (state, metrics)
    eval_batch(batch)             -> a validation batch as the eval step reads it, now
    checkpoint(step)              -> the numpy tree saved with step `step`, or None

  fine-tuning and decoding (`train`, `load_run`)
    outside_params                whether the tables live outside the params (host, file):
                                  a fine-tuning source's tables then go to `open`
    check_workdir(workdir, local) raise if the tables cannot be read from this workdir
    decoding_tables(checkpointer, step, workdir) -> {layer: HostTable | TableFile} or None
    decoding_config(cfg)          -> the config to decode with (its params hold the tables)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

# init_tables(seed) -> {layer: table [R, C] float32 numpy}: the trainer's model init of the
# tables computed on the host CPU (the model lives above Engram, so it is passed in)
InitTables = Callable[[int], dict]


class TableStrategy(Protocol):
    """Where a run keeps its Engram tables and their optimizer states (module doc)."""

    name: str  # "device" | "sparse" | "host" | "file"
    outside_params: bool  # tables not in TrainState.params (host, file)

    def state_params(self, params: Any) -> Any:
        """The params tree the TrainState holds (boxed or plain): `params`, or `params`
        without the tables when they live elsewhere."""

    def optax_config(self, optim_cfg: Any) -> Any:
        """The OptimConfig optax is built from: grad_clip 0 when the step clips itself."""

    def optax_params(self, params: Any) -> Any:
        """The params optax covers (all of them, or all but the tables)."""

    def init_opt_state(self, optimizer: Any, params: Any) -> Any:
        """TrainState.opt_state for `params` (the state's params, boxed or plain)."""

    def opt_state_shardings(self, state_shardings: Any) -> Any:
        """`state_shardings` (a TrainState of shardings) with the table states' shardings."""

    def train_step(
        self,
        dense_step: Callable,
        forward_loss: Callable,
        optimizer: Any,
        schedule: Callable,
        module_norms: Callable,
    ) -> Callable:
        """The un-jitted step: `dense_step(state, batch) -> (state, metrics)` (the trainer's
        optax step over every param), or this placement's own built from
        forward_loss(params, batch) -> (loss, metrics), the optax `optimizer`, the lr
        `schedule(step)` and module_norms(prefix, tree) -> {name: norm}."""

    def step_out_shardings(self, out_shardings: tuple, replicated: Any) -> tuple:
        """The jitted step's out_shardings: (state, metrics) plus any outputs of its own."""

    def batch_shardings(self, shardings: dict, replicated: Any) -> dict:
        """The batch's in_shardings {key: sharding}, plus entries this placement adds."""

    def finish_step(self, outputs: tuple) -> tuple:
        """What the step function returns, given the jitted step's outputs: usually them
        unchanged; sparse sinkhorn tables run their row update here (its own program)."""

    def open(
        self,
        checkpointer: Any,
        step: int,
        workdir: str,
        init_tables: InitTables,
        source_tables: dict | None = None,
    ) -> None:
        """Make the run's tables as of `step`: restored from the checkpoint of `step` when
        > 0, else `source_tables` ({layer: [R, C]}, a fine-tuning source's) or
        init_tables(seed). Called again for another step replaces them."""

    def prepare_batch(self, batch: dict) -> dict:
        """The numpy batch as the step reads it; runs in the prefetch thread, ahead."""

    def step(
        self, train_step: Callable, to_device: Callable, state: Any, batch: dict
    ) -> tuple[Any, dict]:
        """One training step: `train_step(state, to_device(batch))` plus what this
        placement does around it. Returns (state, metrics)."""

    def eval_batch(self, batch: dict) -> dict:
        """A validation batch (already `prepare_batch`-free) as the eval step reads it, with
        the tables as they are now."""

    def checkpoint(self, step: int) -> Any:
        """The numpy tree the checkpoint of `step` stores besides the state, or None; the
        caller saves it in the same step (after this returns, before the next step)."""

    def check_workdir(self, workdir: Any, local: bool) -> None:
        """Raise when this placement's tables cannot be read from `workdir`."""

    def decoding_config(self, cfg: Any) -> Any:
        """The config that evaluates and decodes this run: the same model, with the tables
        as params (placement "device") when training kept them outside."""

    def decoding_tables(self, checkpointer: Any, step: int, workdir: str) -> dict | None:
        """{layer: HostTable | TableFile} of checkpoint `step` for decoding, read-only; None
        when the tables are in the params."""
