"""Engram tables as ordinary params on the device (`optim.table_optimizer = "adam"`).

Keeps: each table [R, C] in TrainState.params, its Adam moments in optax's state (the
`table_param_group`: its own LR scale and weight decay), both sharded like any param.
Step cost: the dense step: the table's full gradient [R, C] is formed (zero outside the
batch's rows) and optax reads and writes every row of the table and both moments.
Checkpoint: nothing besides the train state.

This is also the base every other placement overrides: each method here is the answer
"nothing to do" of the `TableStrategy` contract (`strategy`).
"""

from __future__ import annotations

from v41jax.config import Config


class DeviceTableStrategy:
    """The `TableStrategy` of tables that are params trained by the dense step."""

    name = "device"
    outside_params = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # building the train state
    def state_params(self, params):
        return params

    def optax_config(self, optim_cfg):
        return optim_cfg

    def optax_params(self, params):
        return params

    def init_opt_state(self, optimizer, params):
        return optimizer.init(params)

    def opt_state_shardings(self, state_shardings):
        return state_shardings

    # building the step
    def train_step(self, dense_step, forward_loss, optimizer, schedule, module_norms):
        return dense_step

    def step_out_shardings(self, out_shardings: tuple, replicated) -> tuple:
        return out_shardings

    def batch_shardings(self, shardings: dict, replicated) -> dict:
        return shardings

    def finish_step(self, outputs: tuple) -> tuple:
        return outputs

    # running
    def open(self, checkpointer, step: int, workdir: str, init_tables, source_tables=None):
        return None

    def prepare_batch(self, batch: dict) -> dict:
        return batch

    def step(self, train_step, to_device, state, batch: dict):
        return train_step(state, to_device(batch))

    def eval_batch(self, batch: dict) -> dict:
        return batch

    def checkpoint(self, step: int):
        return None

    # fine-tuning and decoding
    def check_workdir(self, workdir, local: bool) -> None:
        return None

    def decoding_config(self, cfg: Config) -> Config:
        return cfg

    def decoding_tables(self, checkpointer, step: int, workdir: str):
        return None
