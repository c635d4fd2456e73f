"""Configs of a DSpark drafter (DeepSeek-V4.1 report) and of its frozen-backbone training.

A drafter run is described by one `DrafterRunConfig`, saved as `drafter.json` in its workdir
and changed from the CLI with `--set drafter.block_size=7`, `--set train.steps=400`, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from v41jax import config as config_lib

DRAFTER_KINDS = ("dspark", "parallel", "mtp1")
# What each kind fixes: `--set drafter.kind=mtp1` alone is a valid drafter.
KIND_DEFAULTS = {"dspark": {}, "parallel": {"markov_rank": 0}, "mtp1": {"block_size": 1}}
CONFIDENCE_INPUTS = ("hidden", "prev_token")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter network.

    kind: "dspark" (parallel block + Markov head), "parallel" (the same block without the
        Markov head: Medusa-like independent heads; markov_rank 0), "mtp1" (one draft per
        round: an MTP-1-style single block; block_size 1). `override_run_config` sets what
        the kind fixes (KIND_DEFAULTS) unless the same assignments set it.
    block_size: K, drafts per round; the input block is [anchor, mask x (K - 1)].
    target_layer_ids: target layers whose outputs (concatenated) are the context; () -> the
        last min(3, num_layers) layers.
    window: context positions a draft block sees: anchor_pos - window <= s < anchor_pos.
    markov_rank: rank r of the transition term u(x_{k-1}) . w(v); 0 turns it off.
    markov_context: H > 0 makes the transition vector read draft position k's hidden state
        too (`v41jax.dspark.markov`: u_k = u(x_{k-1}) + gelu(hidden_k h + t(x_{k-1})) o,
        an MLP of width H); 0 = the plain low-rank transition.
    d_ff: SwiGLU width of the drafter blocks; 0 -> the target's d_ff.
    confidence_input: what the confidence head reads (`v41jax.dspark.drafter.draft_confidence`,
        docs/dspark.md section 3). "hidden": c_k = sigmoid(w . hidden_k + b), fixed before any
        draft is sampled, so any function of the confidences may pick the verify length.
        "prev_token" (the DSpark paper's head, arXiv 2607.05147): c_k = sigmoid(w . [hidden_k ;
        u(x_{k-1})] + b) with u the Markov head's previous-token table and x_0 the anchor; it
        depends on the sampled drafts, so only a stopping rule (the scheduler's
        admission="early_stop") keeps the output law. Needs the Markov head (kind "dspark",
        markov_rank > 0). Runs saved before this field read as "hidden".
    """

    kind: str = "dspark"
    block_size: int = 5
    target_layer_ids: tuple[int, ...] = ()
    num_layers: int = 3
    num_heads: int = 4
    d_ff: int = 0
    window: int = 128
    markov_rank: int = 32
    markov_context: int = 0
    confidence_input: str = "hidden"
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        _require(self.kind in DRAFTER_KINDS, f"drafter.kind={self.kind!r} not in {DRAFTER_KINDS}")
        for name in ("block_size", "num_layers", "num_heads", "window"):
            v = getattr(self, name)
            _require(v >= 1, f"drafter.{name}={v} must be >= 1")
        _require(self.markov_rank >= 0, f"drafter.markov_rank={self.markov_rank} must be >= 0")
        _require(self.d_ff >= 0, f"drafter.d_ff={self.d_ff} must be >= 0")
        _require(
            self.markov_context >= 0, f"drafter.markov_context={self.markov_context} must be >= 0"
        )
        _require(
            self.markov_context == 0 or (self.kind == "dspark" and self.markov_rank > 0),
            f"drafter.markov_context={self.markov_context} needs the Markov head "
            f"(kind='dspark', markov_rank > 0; got kind={self.kind!r}, "
            f"markov_rank={self.markov_rank})",
        )
        _require(
            self.confidence_input in CONFIDENCE_INPUTS,
            f"drafter.confidence_input={self.confidence_input!r} not in {CONFIDENCE_INPUTS}",
        )
        _require(
            self.confidence_input != "prev_token" or self.uses_markov,
            f"drafter.confidence_input='prev_token' reads the Markov head's previous-token table "
            f"(kind='dspark', markov_rank > 0; got kind={self.kind!r}, "
            f"markov_rank={self.markov_rank})",
        )
        _require(
            self.kind != "mtp1" or self.block_size == 1,
            f"drafter.kind='mtp1' drafts one token per round: block_size={self.block_size} != 1",
        )
        _require(
            self.kind != "parallel" or self.markov_rank == 0,
            f"drafter.kind='parallel' has no Markov head: markov_rank={self.markov_rank} != 0",
        )

    @property
    def uses_markov(self) -> bool:
        return self.kind == "dspark" and self.markov_rank > 0

    def layer_ids_for(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers read as context (validated against the target's depth)."""
        ids = self.target_layer_ids or tuple(
            range(max(0, target_num_layers - 3), target_num_layers)
        )
        bad = [i for i in ids if not -1 <= i < target_num_layers]
        _require(
            not bad and len(set(ids)) == len(ids),
            f"drafter.target_layer_ids={ids}: must be distinct layers in "
            f"[-1, {target_num_layers}) (-1 = embeddings)",
        )
        return ids


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
