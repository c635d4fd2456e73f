"""Batched DSpark speculative decoding with per-round verify widths (DeepSeek-V4.1 report).

`dspark_generate` runs the speculative engine (`v41jax.decode.engine`) with the
DSpark drafter plug-in (`v41jax.dspark.decode.rounds.DSparkProposer`): draft K tokens in one drafter
pass plus the Markov head, choose the verify width w from draft-side information only, verify
[pending, d_1 .. d_w] with the target, `speculative_sample`. Mode "fixed" runs the whole
generation as one `lax.while_loop` at a static width (the device loop); mode "scheduled" (or
`loop="host"`) runs the host loop, one compiled program per width (`speculative_loops`).

The scheduler trades expected tokens against the measured cost of a whole round at each width,
timed inside the loop (`measure_round_cost`): the drafter pass, the Markov sampling and the
context write are paid whatever w is, so a verify-only table would overstate what a longer
verify costs. The table also holds the cost of a plain decode round (width 0, no drafter
pass), so the scheduler can choose not to draft when drafting does not pay.
Greedy (temperature 0) output equals plain greedy decoding token for token.
Requirement: max(prompt length) + max_new_tokens + 2K + 1 <= target max_seq_len.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from tqdm.auto import tqdm

from v41jax.config import ModelConfig
from v41jax.decode.engine import Ctx, Static, check_prompt_batch, draft_step
from v41jax.decode.generate import check_compression
from v41jax.decode.loops import host_segment, host_start, plain_segment, run_rounds
from v41jax.decode.sampling import GREEDY, SamplingParams
from v41jax.dspark.decode.admission import Admission
from v41jax.dspark.decode.rounds import DSparkProposer, ScheduledWidth
from v41jax.dspark.decode.scheduler import CostTable
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import FrozenTarget, frozen_target

Mode = Literal["fixed", "scheduled"]
MODES: tuple[Mode, ...] = get_args(Mode)
LoopChoice = Literal["auto", "device", "host"]  # "auto": "device" when fixed, else "host"
LOOPS: tuple[LoopChoice, ...] = get_args(LoopChoice)
# The sampling settings a timed round draws with: temperature 1, no filters.
TIMED_SAMPLING = SamplingParams(temperature=1.0)


class DSparkOutput(NamedTuple):
    """tokens int32 [B, N]; rounds int32 [B]; and a per-round log, R = N rounds at most:
    confidence float32 [R, B, K] (sigmoid of the confidence head), verify_len int32 [R, B],
    accepted int32 [R, B], active bool [R, B] (row still generating in that round)."""

    tokens: jax.Array
    rounds: jax.Array
    confidence: jax.Array
    verify_len: jax.Array
    accepted: jax.Array
    active: jax.Array


def admission_for(drafter: DrafterConfig) -> Admission:
    """The scheduler's admission rule that keeps the output law with this drafter's
    confidences: "global" for the hidden-state head (its confidences precede every draft),
    "early_stop" for the prev-token head (c_k reads draft k-1)."""
    return "early_stop" if drafter.confidence_input == "prev_token" else "global"


def check_dspark_args(
    target_cfg: ModelConfig,
    drafter: DrafterConfig,
    prompt_shape,
    lengths,
    n_new: int,
    mode: Mode,
    verify_len: int | None,
    loop: LoopChoice = "auto",
) -> None:
    k = drafter.block_size
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} not in {MODES}")
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} not in {LOOPS}")
    if mode == "scheduled" and loop == "device":
        raise ValueError(
            "loop='device' runs one static verify width; mode='scheduled' needs loop='host'"
        )
    if verify_len is not None and not 1 <= verify_len <= k:
        raise ValueError(f"verify_len={verify_len} must be in [1, block_size={k}]")
    check_prompt_batch(prompt_shape, lengths, n_new)
    lengths = np.asarray(lengths)
    need = int(lengths.max()) + n_new + 2 * k + 1
    if max(need, prompt_shape[1]) > target_cfg.max_seq_len:
        raise ValueError(
            f"prompt length {int(lengths.max())} + max_new_tokens {n_new} + 2 * block_size {k}"
            f" + 1 = {need} exceeds the target's max_seq_len {target_cfg.max_seq_len} (a "
            "drafter needs 2 x block_size + 1 positions of slack beyond plain decoding: the "
            "last round's draft block and its verify; shorten the prompt or max_new_tokens)"
        )


def dspark_generate(
    target_params: Any,
    target_cfg: ModelConfig,
    drafter_params: Any,
    drafter: DrafterConfig,
    frozen: FrozenTarget,
    prompt_tokens_BxP: Any,
    prompt_lengths_B: Any,
    *,
    max_new_tokens: int,
    mode: Mode = "fixed",
    verify_len: int | None = None,
    cost: CostTable | None = None,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    compression: Any = None,
    loop: LoopChoice = "auto",
    admission: Admission | None = None,
) -> DSparkOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens with DSpark drafts.

    mode "fixed" verifies `verify_len` (default K) drafts per row per round; "scheduled"
    chooses each round's width from the confidences and `cost` (required; a round-cost table
    from `measure_round_cost`). loop "auto" is "device" for fixed, "host" for scheduled; both
    loops give the same tokens for the same rng. admission (scheduled mode): None picks the
    one that keeps the drafter's confidences lossless (`admission_for`); "global" with the
    prev-token confidence head is refused. The output is distributed exactly as
    `generate(target_params, ...)` with the same sampling settings.
    """
    shape = tuple(np.shape(prompt_tokens_BxP))
    if admission not in (None, "early_stop") and admission_for(drafter) == "early_stop":
        raise ValueError(
            f"admission={admission!r} with drafter.confidence_input='prev_token' is not "
            "lossless (its c_k reads the sampled draft k-1): use admission='early_stop'"
        )
    check_dspark_args(
        target_cfg, drafter, shape, prompt_lengths_B, max_new_tokens, mode, verify_len, loop
    )
    if mode == "scheduled" and cost is None:
        raise ValueError("mode='scheduled' needs the engine's round cost table (cost=...)")
    if cost is not None and not isinstance(cost, CostTable):
        raise ValueError(f"cost must be a CostTable, got {type(cost).__name__}")
    check_compression(target_cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
    c = Ctx(
        nn.unbox(target_params),
        (nn.unbox(drafter_params), frozen),
        sampling.as_arrays(),
        compression,
        lengths + max_new_tokens,
    )
    if mode == "scheduled":
        policy = ScheduledWidth(cost, admission or admission_for(drafter))
    else:
        policy = verify_len or drafter.block_size
    st = Static(target_cfg, DSparkProposer(drafter, target_cfg), max_new_tokens, policy)
    prompts = jnp.asarray(prompt_tokens_BxP, jnp.int32)
    rng = jax.random.key(0) if rng is None else rng
    if loop == "auto":
        loop = "host" if mode == "scheduled" else "device"
    return DSparkOutput(*run_rounds(c, prompts, lengths, rng, st, loop))


def measure_round_cost(
    target_params,
    target_cfg: ModelConfig,
    drafter_params,
    drafter: DrafterConfig,
    frozen: FrozenTarget,
    batch_size: int,
    *,
    rounds: int | None = None,
    passes: int = 3,
    sampling: SamplingParams = TIMED_SAMPLING,
    compression: Any = None,
    progress: bool = False,
    include_plain: bool = True,
) -> CostTable:
    """Seconds of one decode round at each verify width w = 0 .. K, B rows, as the loop runs
    it: for w >= 1 the drafter pass, Markov sampling, the target's verify of w + 1 tokens per
    row, the acceptance rule and the context write; for w = 0 (`include_plain`) a plain
    decode round: the target's step on the pending token and the context write, no drafter
    pass. Per pass and width: a fresh prefill, then a whole decode of `rounds` (K + 1) new
    tokens at width w as one segment (the program the scheduled loop runs: `host_segment`),
    timed and divided by the rounds it ran (>= `rounds`; default 16 or as many as
    max_seq_len holds); w = 0 runs `rounds` rounds of `plain_segment` (one token each: a
    whole decode would run K + 1 times as many rounds as the widest width for no extra
    precision). The first pass also compiles and is discarded; the cost is the min over the
    other `passes`.

    Timed inside the loop on purpose: a launch and a sync per round add a fixed cost to every
    width that flattens the table and hides that short widths are cheaper. `progress` shows
    a bar over the timed decodes. Returns CostTable(tokens = B (1 + w), seconds), the table
    `schedule_verify_lengths(basis="width")` reads; its B-token entry is the plain round."""
    k, s = drafter.block_size, target_cfg.max_seq_len
    if rounds is None:  # 16, or as many as the target's context holds
        rounds = max(1, min(16, (s - 2 * k - 2) // (k + 1)))
    for name, val in (("batch_size", batch_size), ("rounds", rounds), ("passes", passes)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}={val!r} must be an int >= 1")
    # every row stays active for >= `rounds` rounds: a round emits <= K + 1 tokens per row
    n_new = rounds * (k + 1)
    if 1 + n_new + 2 * k + 1 > s:
        raise ValueError(
            f"rounds={rounds}: 1 + {n_new} new tokens + 2K + 1 exceeds max_seq_len {s}"
        )
    b = batch_size
    lengths = jnp.ones((b,), jnp.int32)
    sampling = sampling.as_arrays()
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    c = Ctx(
        nn.unbox(target_params),
        (nn.unbox(drafter_params), frozen),
        sampling,
        compression,
        lengths + n_new,
    )
    prompts = jnp.zeros((b, 1), jnp.int32)
    proposer = DSparkProposer(drafter, target_cfg)
    tick = time.get_clock_info("perf_counter").resolution

    def seconds_per_round(w: int, p: int) -> float:
        st = Static(target_cfg, proposer, n_new, w)
        state, d, _ = jax.block_until_ready(host_start(c, prompts, lengths, jax.random.key(p), st))
        r0 = int(state.r)
        start = time.perf_counter()
        if w == 0:
            segment = plain_segment(c, state, d, st, jnp.int32(rounds))
        else:
            segment = host_segment(c, state, d, st, w)
        state = jax.block_until_ready(segment)[0]
        elapsed = time.perf_counter() - start
        return max(elapsed, tick) / (int(state.r) - r0)

    widths = list(range(0 if include_plain else 1, k + 1))
    best = {w: float("inf") for w in widths}
    bar = tqdm(total=(passes + 1) * len(widths), desc="timing widths", disable=not progress)
    for p in range(passes + 1):  # pass 0 compiles
        for w in widths[:: 1 if p % 2 == 0 else -1]:  # alternate the order: drift
            secs = seconds_per_round(w, p)
            if p:
                best[w] = min(best[w], secs)
            bar.update(1)
    bar.close()
    return CostTable(tuple(b * (1 + w) for w in widths), tuple(best[w] for w in widths))


def load_or_measure_cost(
    drafter_workdir: str,
    target_params,
    target_cfg: ModelConfig,
    drafter_params,
    drafter: DrafterConfig,
    batch_size: int,
    compression: Any = None,
    progress: bool = True,
    *,
    rounds: int | None = None,
    passes: int = 3,
) -> CostTable:
    """The round-cost table saved with the drafter run for this batch size, measured on first
    use (`loop_round_cost_b{B}.json`; delete it to re-measure on another machine). Measuring
    compiles and times K + 1 decodes per pass (`rounds`, `passes`: `measure_round_cost`); it
    says so on stderr and shows `progress`."""
    path = os.path.join(drafter_workdir, f"loop_round_cost_b{batch_size}.json")
    if os.path.exists(path):
        return CostTable.load(path)
    print(
        f"measuring the decode-round cost at verify widths 0..{drafter.block_size} for batch "
        f"{batch_size} (once per drafter and batch size; saved to {path})",
        file=sys.stderr,
    )
    frozen = frozen_target(target_params, target_cfg)
    cost = measure_round_cost(
        target_params,
        target_cfg,
        drafter_params,
        drafter,
        frozen,
        batch_size,
        rounds=rounds,
        passes=passes,
        compression=compression,
        progress=progress,
    )
    cost.save(path)
    return cost


@functools.partial(jax.jit, static_argnames=("st", "n"))
def _draft_passes(c: Ctx, state, st: Static, n: int):
    """n drafter passes on the same context (the key advances), outputs kept alive."""

    def body(_, carry):
        state, acc = carry
        state, d = draft_step(c, state, st)
        p = d.proposal
        return state._replace(rng=d.rng), acc + p.confidence.sum() + p.q[..., 0].sum()

    return jax.lax.fori_loop(0, n, body, (state, jnp.float32(0)))[1]


def measure_draft_cost(
    target_params,
    target_cfg: ModelConfig,
    drafter_params,
    drafter: DrafterConfig,
    frozen: FrozenTarget,
    batch_size: int,
    *,
    passes_of: int = 16,
    passes: int = 3,
    sampling: SamplingParams = TIMED_SAMPLING,
    compression: Any = None,
) -> float:
    """Seconds of the draft side of one round alone, B rows: the drafter pass, the Markov
    sampling and the confidences (`draft_step`), timed as `passes_of` passes in one program
    after a prefill of a 16-token prompt; min over `passes` timings after one that compiles.
    With `measure_round_cost` it splits a round into drafting c and verifying v(L)."""
    for name, val in (("batch_size", batch_size), ("passes_of", passes_of), ("passes", passes)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}={val!r} must be an int >= 1")
    b, p_len = batch_size, 16
    lengths = jnp.full((b,), p_len, jnp.int32)
    sampling = sampling.as_arrays()
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    c = Ctx(
        nn.unbox(target_params),
        (nn.unbox(drafter_params), frozen),
        sampling,
        compression,
        lengths + 1 + drafter.block_size,
    )
    st = Static(target_cfg, DSparkProposer(drafter, target_cfg), 1, drafter.block_size)
    prompts = jnp.zeros((b, p_len), jnp.int32)
    state = jax.block_until_ready(host_start(c, prompts, lengths, jax.random.key(0), st)[0])
    best = float("inf")
    for p in range(passes + 1):  # pass 0 compiles
        start = time.perf_counter()
        jax.block_until_ready(_draft_passes(c, state, st, passes_of))
        if p:
            best = min(best, (time.perf_counter() - start) / passes_of)
    return best


def load_or_measure_draft_cost(
    drafter_workdir: str,
    target_params,
    target_cfg: ModelConfig,
    drafter_params,
    drafter: DrafterConfig,
    batch_size: int,
    compression: Any = None,
) -> float:
    """`measure_draft_cost`, saved with the drafter run (`draft_cost_b{B}.json`) on first use."""
    path = os.path.join(drafter_workdir, f"draft_cost_b{batch_size}.json")
    if os.path.exists(path):
        with open(path) as f:
            return float(json.load(f)["seconds"])
    frozen = frozen_target(target_params, target_cfg)
    secs = measure_draft_cost(
        target_params,
        target_cfg,
        drafter_params,
        drafter,
        frozen,
        batch_size,
        compression=compression,
    )
    with open(path, "w") as f:
        json.dump({"seconds": secs, "batch_size": batch_size}, f)
    return secs
