"""The config of a DSpark drafter network (DeepSeek-V4.1 report): `DrafterConfig`.

Its training settings and the run config that pairs the two (`DrafterRunConfig`, saved as
`drafter.json`) are `v41jax.dspark.train.config`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        round: an MTP-1-style single block; block_size 1).
        `v41jax.dspark.train.config.override_run_config` sets what the kind fixes
        (KIND_DEFAULTS) unless the same assignments set it.
    block_size: K, drafts per round; the input block is [anchor, mask x (K - 1)].
    target_layer_ids: target layers whose outputs (concatenated) are the context; () -> the
        last min(3, num_layers) layers.
    window: context positions a draft block sees: anchor_pos - window <= s < anchor_pos.
    markov_rank: rank r of the transition term u(x_{k-1}) . w(v); 0 turns it off.
    markov_context: H > 0 makes the transition vector read draft position k's hidden state
        too (`v41jax.dspark.model.markov`: u_k = u(x_{k-1}) + gelu(hidden_k h + t(x_{k-1})) o,
        an MLP of width H); 0 = the plain low-rank transition.
    d_ff: SwiGLU width of the drafter blocks; 0 -> the target's d_ff.
    confidence_input: what the confidence head reads
        (`v41jax.dspark.model.drafter.draft_confidence`,
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
