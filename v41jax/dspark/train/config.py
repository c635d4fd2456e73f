"""Configs of a drafter's frozen-backbone training (`DrafterTrainConfig`) and of a whole
drafter run (`DrafterRunConfig`: the network and its training), saved as `drafter.json` in
the run's workdir and changed from the CLI with `--set drafter.block_size=7`,
`--set train.steps=400`, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from v41jax import config as config_lib
from v41jax.dspark.config import KIND_DEFAULTS, DrafterConfig


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Frozen-backbone drafter training on anchors sampled from packed sequences of text
    (`data_paths`; default the target's training text; e.g. the target's own samples,
    `v41jax.dspark.self_text`).

    Loss per anchor and position k = 1..K (weights decay^(k-1)):
        CE(p_k, q_k) + tv_weight * TV(q_k, p_k) + conf_weight * BCE(c_k, 1 - TV(q_k, p_k))
    with p_k the target's distribution (`targets="distribution"`) or a one-hot of the corpus
    token (`targets="tokens"`), q_k the drafter's (Markov term on the true previous token).
    """

    steps: int = 600
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 16
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    decay: float = 0.8
    tv_weight: float = 0.0
    conf_weight: float = 1.0
    targets: str = "distribution"
    data_paths: tuple[str, ...] = ()  # text for the anchors; () = the target's training text
    seed: int = 0
    log_every: int = 20
    eval_every: int = 200  # 0 -> only at the end
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 2

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq", "log_every", "checkpoint_every"):
            v = getattr(self, name)
            _require(v >= 1, f"train.{name}={v} must be >= 1")
        _require(self.lr > 0, f"train.lr={self.lr} must be > 0")
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
