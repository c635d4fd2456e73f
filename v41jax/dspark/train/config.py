"""Configs of a drafter's frozen-backbone training (`DrafterTrainConfig`) and of a whole
drafter run (`DrafterRunConfig`: the network and its training), saved as `drafter.json` in
the run's workdir and changed from the CLI with `--set drafter.block_size=7`,
`--set train.steps=400`, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from v41jax import config as config_lib
from v41jax.config import OptimConfig, TrainConfig
from v41jax.dspark.model.config import KIND_DEFAULTS, DrafterConfig


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


# The settings a drafter run takes from the main trainer's configs, as its own `train.*` keys
# (drafter.json and `--set train.lr=...` as before: `config.inline`).
OPTIM_FIELDS = ("lr", "warmup_steps", "weight_decay", "grad_clip")
LOOP_FIELDS = (
    "steps",
    "seed",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
)


def drafter_optim() -> OptimConfig:
    """The drafter's optimizer: AdamW (b1 0.9, b2 0.95), warmup then a cosine to 0.1 x lr,
    one parameter group (no `param_groups`: `weight_decay` on every parameter)."""
    return OptimConfig(
        lr=2e-3,
        warmup_steps=50,
        min_lr_ratio=0.1,
        b1=0.9,
        b2=0.95,
        weight_decay=0.0,
        grad_clip=1.0,
        param_groups=(),
    )


def drafter_loop() -> TrainConfig:
    """The drafter's step loop: its length, seed, log / eval / checkpoint cadence."""
    return TrainConfig(
        steps=600,
        seed=0,
        log_every=20,
        eval_every=200,
        eval_batches=4,
        checkpoint_every=100,
        keep_checkpoints=2,
    )


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Frozen-backbone drafter training on anchors sampled from packed sequences of text
    (`data_paths`; default the target's training text; e.g. the target's own samples,
    `v41jax.dspark.train.self_text`).

    Loss per anchor and position k = 1..K (weights decay^(k-1)):
        CE(p_k, q_k) + tv_weight * TV(q_k, p_k) + conf_weight * BCE(c_k, 1 - TV(q_k, p_k))
    with p_k the target's distribution (`targets="distribution"`) or a one-hot of the corpus
    token (`targets="tokens"`), q_k the drafter's (Markov term on the true previous token).

    optim: the main trainer's `OptimConfig`; `train.lr`, `warmup_steps`, `weight_decay` and
        `grad_clip` are its settings (the rest: `drafter_optim`).
    loop: the main trainer's `TrainConfig`, of which `train.steps`, `seed`, `log_every`,
        `eval_every` (0 -> only at the end), `eval_batches`, `checkpoint_every` and
        `keep_checkpoints` are settings; the drafter reads nothing else of it.
    """

    optim: OptimConfig = config_lib.inline(drafter_optim, OPTIM_FIELDS)
    loop: TrainConfig = config_lib.inline(drafter_loop, LOOP_FIELDS)
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 16
    decay: float = 0.8
    tv_weight: float = 0.0
    conf_weight: float = 1.0
    targets: str = "distribution"
    data_paths: tuple[str, ...] = ()  # text for the anchors; () = the target's training text

    def __post_init__(self):
        counts = {
            "steps": self.loop.steps,
            "batch_size": self.batch_size,
            "anchors_per_seq": self.anchors_per_seq,
            "log_every": self.loop.log_every,
            "checkpoint_every": self.loop.checkpoint_every,
        }
        for name, v in counts.items():
            _require(v >= 1, f"train.{name}={v} must be >= 1")
        _require(self.optim.lr > 0, f"train.lr={self.optim.lr} must be > 0")
        _require(0.0 < self.decay <= 1.0, f"train.decay={self.decay} must be in (0, 1]")
        _require(self.tv_weight >= 0, f"train.tv_weight={self.tv_weight} must be >= 0")
        _require(self.conf_weight >= 0, f"train.conf_weight={self.conf_weight} must be >= 0")
        _require(
            self.targets in ("distribution", "tokens"),
            f"train.targets={self.targets!r} not in ('distribution', 'tokens')",
        )


@dataclass(frozen=True)
class DrafterRunConfig:
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)


def override_run_config(cfg: DrafterRunConfig, assignments: list[str]) -> DrafterRunConfig:
    """`config.override` for drafter runs: `drafter.kind=K` also sets the fields kind K fixes
    (KIND_DEFAULTS: mtp1 -> block_size=1, parallel -> markov_rank=0) unless the same
    assignments set them, so `--set drafter.kind=mtp1` alone is valid."""
    keys = {a.split("=", 1)[0].strip() for a in assignments}
    implied = []
    for a in assignments:
        key, _, value = a.partition("=")
        if key.strip() == "drafter.kind":
            implied += [
                f"drafter.{name}={v}"
                for name, v in KIND_DEFAULTS.get(value.strip(), {}).items()
                if f"drafter.{name}" not in keys
            ]
    return config_lib.override(cfg, implied + list(assignments))
