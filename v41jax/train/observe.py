"""What a training run shows besides metrics.jsonl: TensorBoard scalars, a profiler trace of
chosen steps, and model FLOP/s with MFU.

- `TensorBoard`: every numeric field of every metrics record as a scalar at its step, in
  WORKDIR/tensorboard (tensorboardX: event files without TensorFlow). Train fields go under
  `train/`, eval fields (`val_*`, `eval_*`) under `eval/`. A resumed run purges the events a
  killed run wrote after its last checkpoint, as metrics.jsonl moves those lines aside.
- `Profiler`: `train.profile_steps = "a,b"` traces steps a..b with `jax.profiler` into
  WORKDIR/profile (open it with TensorBoard's profile plugin or Perfetto).
- `flops_metrics`: model FLOP/s = tokens/s x training FLOPs per token (6 N_matmul + the
  attention term, `v41jax.model.accounting`), and MFU = that / (devices x peak FLOP/s). The
  peak is `train.peak_flops` or the device kind's dense bf16 peak; a CPU has none (no MFU).
"""

from __future__ import annotations

import os

import jax

from v41jax.config import Config
from v41jax.model.accounting import model_flops_per_token
from v41jax.train.workdir import as_path

# dense bf16 FLOP/s per chip, by a substring of `device.device_kind` (first match wins)
PEAK_FLOPS = (
    ("v6 lite", 918e12),  # TPU v6e
    ("v5 lite", 197e12),  # TPU v5e
    ("v5e", 197e12),
    ("v5p", 459e12),
    ("v5", 459e12),
    ("v4", 275e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops_per_device(cfg: Config, device=None) -> float | None:
    """`train.peak_flops` if set, else the table's entry for the device kind, else None."""
    if cfg.train.peak_flops:
        return cfg.train.peak_flops
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for key, peak in PEAK_FLOPS if key in kind), None)


def flops_metrics(cfg: Config, tokens_per_s: float) -> dict[str, float]:
    """{"model_flops_per_s"} and, when the peak is known, {"mfu"} for the whole job."""
    flops = tokens_per_s * model_flops_per_token(cfg.model, cfg.data.seq_len)
    out = {"model_flops_per_s": flops}
    peak = peak_flops_per_device(cfg)
    if peak:
        out["mfu"] = flops / (peak * jax.device_count())
    return out


class TensorBoard:
    """Scalars of metrics records in `directory` (no-op when disabled)."""

    def __init__(self, directory: str | os.PathLike, resume_step: int, enabled: bool = True):
        self.writer = None
        if enabled:
            from tensorboardX import SummaryWriter

            # purge_step hides events at steps > resume_step left by a killed run; gs:// and
            # s3:// are written by tensorboardX itself (`workdir.check_local_features`)
            self.writer = SummaryWriter(os.fspath(directory), purge_step=resume_step + 1)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            group = "eval" if key.startswith(("val_", "eval_")) else "train"
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Profiler:
    """Traces steps a..b of `train.profile_steps` into `directory`, a local one: the
    training loop refuses the setting with a workdir elsewhere before it starts."""

    def __init__(self, spec: str, directory: str | os.PathLike):
        self.first = self.last = None
        if spec:
            a, _, b = spec.partition(",")
            self.first, self.last = int(a), int(b)
        self.directory, self.active = directory, False

    def before(self, step: int) -> None:
        if step == self.first:
            as_path(self.directory).mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(os.fspath(self.directory))
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and step == self.last:
            jax.block_until_ready(state)  # the traced steps' device work is in the trace
            jax.profiler.stop_trace()
            self.active = False

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
