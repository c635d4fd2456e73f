"""The DSpark drafter as a plug-in of the speculative engine (DeepSeek-V4.1 report).

The round, history, rollback and loops are the engine's (`v41jax.decode.engine`).
The drafter's state is its context cache: per drafter layer, the K/V of the target features of
slots < pos (`Drafter.context_kv`, written once per verified position). Per round:

  propose: one drafter pass over the block [pending, mask x (K-1)] at slots pos .. pos+K-1,
    attending to context slots [pos - window, pos); the Markov head then samples d_1 .. d_K
    sequentially (`markov_draft`), returning q_k, the exact law of d_k, and the confidences.
  observe: after the target verified [pending, d_1 .. d_w], the target features of those
    w + 1 slots go into the context cache (slots past pos + A + 1 are stale, overwritten
    by the next round).
The verify width is fixed, or chosen by `ScheduledWidth` from the confidences and the measured
round-cost table (`schedule_verify_lengths`, `ENGINE_BASIS`). With the hidden-state
confidence head the confidences come from the drafter's pass before any draft is sampled, so
the width never depends on the target or on the sampled drafts and the output law is
unchanged (see `v41jax.speculative.pipeline_audit`). The prev-token head's c_k reads draft
k-1, so its width must come from a stopping rule (admission "early_stop": whether draft j is
verified reads c_1..c_j only), never from the argmax over all K.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from v41jax.config import ModelConfig
from v41jax.decode.engine import Proposal
from v41jax.dspark.decode.admission import Admission
from v41jax.dspark.decode.scheduler import Basis, CostTable, RaggedCost, schedule_verify_lengths
from v41jax.dspark.model.confidence import draft_confidence, previous_tokens
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import Drafter
from v41jax.dspark.model.markov import markov_draft
from v41jax.model.attention import update_cache

# One verify width per round for the whole padded batch: the scheduler prices exactly that
# (basis "width": every active row's first w drafts count), not the ragged budget rule.
ENGINE_BASIS: Basis = "width"


def scheduled_width(
    conf_BxK, cost: CostTable, active_B, useful_B=None, basis: Basis = ENGINE_BASIS, **kw
) -> jax.Array:
    """The round's verify width, int32 scalar in [0, K]: the largest of the scheduler's lengths
    over the active rows (1 if none is active; 0 only when the cost table prices a plain
    round); `kw` go to `schedule_verify_lengths` (e.g. admission)."""
    sched = schedule_verify_lengths(
        conf_BxK, cost, basis=basis, active_B=active_B, useful_B=useful_B, **kw
    )
    widest = jnp.max(jnp.where(active_B, sched.verify_len, 0))
    return jnp.where(jnp.any(active_B), widest, 1).astype(jnp.int32)


@dataclass(frozen=True)
class ScheduledWidth:
    """The engine's width policy of DSpark's scheduled mode: `scheduled_width` on the round's
    confidences and the measured round-cost table. admission "global" (the argmax over
    widths) for the hidden-state confidence head; "early_stop" (a stopping rule: draft j is
    verified on c_1..c_j alone) for the prev-token head, whose c_k reads draft k-1."""

    cost: CostTable
    admission: Admission = "global"

    def __call__(self, conf_BxK, active_B, useful_B) -> jax.Array:
        return scheduled_width(conf_BxK, self.cost, active_B, useful_B, admission=self.admission)


@dataclass(frozen=True)
class ScheduledLengths:
    """The ragged engine's policy of DSpark's scheduled mode: each row's verify length, int32
    [B] in [0, K], from `schedule_verify_lengths(basis="total")` on the round's confidences
    with the measured `RaggedCost` (its packed sizes and the plain round's cost). Needs
    confidences fixed before any draft is sampled (the hidden-state head: admission
    "global"); the budget rule reads every row's c_1 .. c_K."""

    cost: RaggedCost

    def __call__(self, conf_BxK, active_B, useful_B) -> jax.Array:
        sched = schedule_verify_lengths(
            conf_BxK,
            self.cost.rounds,
            basis="total",
            active_B=active_B,
            useful_B=useful_B,
            buckets=self.cost.buckets,
            plain_seconds=self.cost.plain_seconds,
        )
        return sched.verify_len


@dataclass(frozen=True)
class DSparkProposer:
    """The DSpark drafter (`Drafter`) over the frozen target. params: (drafter params,
    `FrozenTarget`); state: the context cache, a list over drafter layers of
    {k, v} [B, S, G, D/G]."""

    drafter: DrafterConfig
    target_cfg: ModelConfig

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def slack(self) -> int:
        return 2 * self.drafter.block_size + 1

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.drafter.layer_ids_for(self.target_cfg.num_layers)

    def seq_len(self, target_cfg: ModelConfig) -> int:
        return target_cfg.max_seq_len

    def _feats(self, out):
        return jnp.concatenate([out.hidden[i] for i in self.hidden_layers], axis=-1)

    def _context_write(self, drafter_params, ctx, out, start_B):
        """Write the drafter-layer K/V of the target features of `out` at slots start ..."""
        module = Drafter(self.drafter, self.target_cfg)
        feats = self._feats(out)
        slots = start_B[:, None] + jnp.arange(feats.shape[1], dtype=jnp.int32)
        new = module.apply({"params": drafter_params}, feats, slots, method=module.context_kv)
        return [
            {name: update_cache(c[name], n[name], start_B) for name in ("k", "v")}
            for c, n in zip(ctx, new, strict=True)
        ]

    def init(self, params, target_out, prompts_BxP, lengths_B, compression):
        cfg, dcfg = self.target_cfg, self.drafter
        b, s = prompts_BxP.shape[0], cfg.max_seq_len
        g, hd = dcfg.num_heads, cfg.d_model // dcfg.num_heads
        ctx = [
            {n: jnp.zeros((b, s, g, hd), jnp.dtype(cfg.compute_dtype)) for n in ("k", "v")}
            for _ in range(dcfg.num_layers)
        ]
        return self._context_write(params[0], ctx, target_out, jnp.zeros((b,), jnp.int32))

    def propose(self, params, ctx, history_BxS, pos_B, active_B, key, probs, compression):
        drafter_params, frozen = params
        dcfg = self.drafter
        b, s = pos_B.shape[0], self.target_cfg.max_seq_len
        module = Drafter(dcfg, self.target_cfg)
        markov = drafter_params.get("markov") if dcfg.uses_markov else None
        pending = jnp.take_along_axis(history_BxS, pos_B[:, None], axis=1)
        # Only the window [pos - W, pos) is visible: attend to a W-slot slice, not all S slots.
        win = min(dcfg.window, s)
        start = jnp.clip(pos_B - win, 0, s - win)
        window = lambda x: jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, win))(x, start)
        d_out = module.apply(
            {"params": drafter_params},
            frozen,
            [{n: window(x[n]) for n in ("k", "v")} for x in ctx],
            start[:, None] + jnp.arange(win, dtype=jnp.int32),
            jnp.ones((b, win), bool),
            pending,
            pos_B[:, None],
            method=module.draft,
        )
        hidden = d_out.hidden[:, 0] if dcfg.markov_context else None
        drafts, q = markov_draft(key, d_out.base_logits[:, 0], pending[:, 0], markov, probs, hidden)
        prev = previous_tokens(pending, drafts[:, None, :])  # [anchor, d_1 .. d_{K-1}]
        conf = draft_confidence(drafter_params, dcfg, d_out, prev)[:, 0]
        return Proposal(drafts, q, conf), ctx

    def observe(self, params, ctx, history_BxS, target_out, start_B, compression):
        return self._context_write(params[0], ctx, target_out, start_B)
