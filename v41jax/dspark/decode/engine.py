"""Batched DSpark speculative decoding with per-round verify widths (DeepSeek-V4.1 report).

`dspark_generate` runs the speculative engine (`v41jax.decode.engine`) with the
DSpark drafter plug-in (`v41jax.dspark.decode.rounds.DSparkProposer`): draft K tokens in one drafter
pass plus the Markov head, choose the verify width w from draft-side information only, verify
[pending, d_1 .. d_w] with the target, `speculative_sample`. Mode "fixed" runs the whole
generation as one `lax.while_loop` at a static width (the device loop); mode "scheduled" (or
`loop="host"`) runs the host loop, one compiled program per width (`speculative_loops`).

Two verify engines (`verify`, `v41jax.decode.engine`): "padded", one width for the batch;
"ragged", each row its own length, the target run once over the packed tokens (sum over rows
of 1 + L_b, padded to a static bucket). Scheduled ragged decoding reads a `RaggedCost` (the
round's cost by packed token count) and schedules with basis "total" (`ScheduledLengths`).

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
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from tqdm.auto import tqdm

from v41jax.config import ModelConfig
from v41jax.decode.engine import (
    VERIFY_ENGINES,
    Ctx,
    Static,
    Verify,
    bucket_ceil,
    check_prompt_batch,
    draft_step,
    packed_buckets,
)
from v41jax.decode.generate import check_compression
from v41jax.decode.loops import host_draft, host_segment, host_start, plain_segment, run_rounds
from v41jax.decode.sampling import GREEDY, SamplingParams
from v41jax.dspark.decode.admission import Admission
from v41jax.dspark.decode.rounds import DSparkProposer, ScheduledLengths, ScheduledWidth
from v41jax.dspark.decode.scheduler import CostTable, RaggedCost
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
    verify: Verify = "padded",
) -> None:
    k = drafter.block_size
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} not in {MODES}")
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} not in {LOOPS}")
    if verify not in VERIFY_ENGINES:
        raise ValueError(f"verify={verify!r} not in {VERIFY_ENGINES}")
    if mode == "scheduled" and loop == "device":
        raise ValueError(
            "loop='device' runs one static verify width; mode='scheduled' needs loop='host'"
        )
    if verify == "ragged" and loop == "device":
        raise ValueError("verify='ragged' picks a packed size per round: it needs loop='host'")
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
    verify: Verify = "padded",
) -> DSparkOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens with DSpark drafts.

    mode "fixed" verifies `verify_len` (default K) drafts per row per round; "scheduled"
    chooses each round's width from the confidences and `cost` (required; a round-cost table
    from `measure_round_cost`). loop "auto" is "device" for fixed, "host" for scheduled; both
    loops give the same tokens for the same rng. admission (scheduled mode): None picks the
    one that keeps the drafter's confidences lossless (`admission_for`); "global" with the
    prev-token confidence head is refused. verify "ragged" (host loop): each row verifies
    its own length in one packed target call; scheduled, `cost` is a `RaggedCost`
    (`measure_round_cost(verify="ragged")`) and the lengths come from basis "total"
    (`ScheduledLengths`; the hidden-state confidence head only). The output is distributed
    exactly as `generate(target_params, ...)` with the same sampling settings.
    """
    shape = tuple(np.shape(prompt_tokens_BxP))
    if admission not in (None, "early_stop") and admission_for(drafter) == "early_stop":
        raise ValueError(
            f"admission={admission!r} with drafter.confidence_input='prev_token' is not "
            "lossless (its c_k reads the sampled draft k-1): use admission='early_stop'"
        )
    check_dspark_args(
        target_cfg,
        drafter,
        shape,
        prompt_lengths_B,
        max_new_tokens,
        mode,
        verify_len,
        loop,
        verify,
    )
    if mode == "scheduled" and cost is None:
        raise ValueError("mode='scheduled' needs the engine's round cost table (cost=...)")
    want = RaggedCost if verify == "ragged" else CostTable
    if cost is not None and not isinstance(cost, want):
        raise ValueError(
            f"verify={verify!r} reads a {want.__name__} (measure_round_cost(verify="
            f"{verify!r})), got {type(cost).__name__}"
        )
    if verify == "ragged" and mode == "scheduled" and admission_for(drafter) == "early_stop":
        raise ValueError(
            "verify='ragged' schedules with the budget rule (basis 'total'), which reads every "
            "confidence: it needs drafter.confidence_input='hidden', not 'prev_token'"
        )
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
    buckets: tuple[int, ...] = ()
    if verify == "ragged":
        buckets = cost.buckets if cost is not None else packed_buckets(shape[0], drafter.block_size)
        if buckets[-1] < shape[0] * (1 + drafter.block_size):
            raise ValueError(
                f"the ragged cost table's buckets end at {buckets[-1]} tokens, below B (1 + K) "
                f"= {shape[0] * (1 + drafter.block_size)}: it was measured for a smaller batch"
            )
    if mode == "scheduled" and verify == "ragged":
        policy = ScheduledLengths(cost)
    elif mode == "scheduled":
        policy = ScheduledWidth(cost, admission or admission_for(drafter))
    else:
        policy = verify_len or drafter.block_size
    proposer = DSparkProposer(drafter, target_cfg)
    st = Static(target_cfg, proposer, max_new_tokens, policy, verify, buckets)
    prompts = jnp.asarray(prompt_tokens_BxP, jnp.int32)
    rng = jax.random.key(0) if rng is None else rng
    if loop == "auto":
        loop = "host" if mode == "scheduled" or verify == "ragged" else "device"
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
    verify: Verify = "padded",
    sizes: tuple[int, ...] | None = None,
) -> CostTable | RaggedCost:
    """Seconds of one decode round at each verify width w = 0 .. K, B rows, as the loop runs
    it: for w >= 1 the drafter pass, Markov sampling, the target's verify of w + 1 tokens per
    row, the acceptance rule and the context write; for w = 0 (`include_plain`) a plain
    decode round: the target's step on the pending token and the context write, and the
    drafter pass that ends the run, shared by its rounds. Per pass and width: a fresh
    prefill, then a whole decode of `rounds` (K + 1) new tokens at width w as one segment
    (the program the scheduled loop runs: `host_segment`), timed and divided by the rounds
    it ran (>= `rounds`; default 16 or as many as max_seq_len holds); w = 0 runs `rounds`
    rounds of `plain_segment` and the drafter pass that ends the run (`host_draft`), as the
    host loop pays it (one token per round: a whole decode would run K + 1 times as many
    rounds as the widest width for no extra precision). The first pass also compiles and is
    discarded; the cost is the min over the other `passes`.

    Timed inside the loop on purpose: a launch and a sync per round add a fixed cost to every
    width that flattens the table and hides that short widths are cheaper. `progress` shows
    a bar over the timed decodes. Returns CostTable(tokens = B (1 + w), seconds), the table
    `schedule_verify_lengths(basis="width")` reads; its B-token entry is the plain round.

    verify "ragged": the same rounds on the ragged engine at each packed size n of `sizes`
    (default: every size of `packed_buckets(B, K)` from 2 up): min(B, n // 2) rows active,
    each verifying >= 1 draft, n tokens in all (`FixedLengths`), the other rows finished.
    Returns a `RaggedCost` (the table by packed size, the buckets, the plain round's
    seconds when `include_plain`)."""
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
    buckets = packed_buckets(b, k) if verify == "ragged" else ()
    if verify == "ragged":
        sizes = tuple(x for x in buckets if x >= 2) if sizes is None else tuple(sizes)
        bad = [x for x in sizes if not (isinstance(x, int) and 2 <= x <= b * (1 + k))]
        if not sizes or bad:
            raise ValueError(
                f"sizes {bad or list(sizes)} must be ints in [2, B (1 + K) = {b * (1 + k)}]"
            )
        points = [0] * include_plain + list(sizes)
    elif verify == "padded":
        points = list(range(0 if include_plain else 1, k + 1))
    else:
        raise ValueError(f"verify={verify!r} not in {VERIFY_ENGINES}")

    def seconds_per_round(point: int, p: int) -> float:
        ctx, policy, program = c, point, point
        if verify == "ragged" and point:
            lens = ragged_lengths(point, b, k)
            ctx = c._replace(end_B=jnp.where(jnp.asarray(lens) > 0, c.end_B, lengths))
            policy = FixedLengths(tuple(max(x, 0) for x in lens))
            program = int(bucket_ceil(point, buckets))
        st = Static(target_cfg, proposer, n_new, policy, verify, buckets)
        state, d, _ = jax.block_until_ready(
            host_start(ctx, prompts, lengths, jax.random.key(p), st)
        )
        r0 = int(state.r)
        start = time.perf_counter()
        if point == 0:  # the run and the drafter pass that decides the next (as host_loop)
            state, _, _ = plain_segment(ctx, state, d, st, jnp.int32(rounds))
            segment = host_draft(ctx, state, st)
        else:
            segment = host_segment(ctx, state, d, st, program)
        state = jax.block_until_ready(segment)[0]
        elapsed = time.perf_counter() - start
        return max(elapsed, tick) / (int(state.r) - r0)

    best = {x: float("inf") for x in points}
    what = "packed sizes" if verify == "ragged" else "widths"
    bar = tqdm(total=(passes + 1) * len(points), desc=f"timing {what}", disable=not progress)
    for p in range(passes + 1):  # pass 0 compiles
        for x in points[:: 1 if p % 2 == 0 else -1]:  # alternate the order: drift
            secs = seconds_per_round(x, p)
            if p:
                best[x] = min(best[x], secs)
            bar.update(1)
    bar.close()
    if verify == "ragged":
        table = CostTable(tuple(sizes), tuple(best[x] for x in sizes))
        return RaggedCost(table, buckets, best[0] if include_plain else None)
    return CostTable(tuple(b * (1 + w) for w in points), tuple(best[w] for w in points))


def ragged_lengths(n: int, b: int, k: int) -> list[int]:
    """Verify lengths of B rows that pack exactly n tokens (2 <= n <= B (1 + K)):
    a = min(B, n // 2) rows active with >= 1 draft each, the rest of the n - 2a drafts spread
    evenly; -1 marks a finished row."""
    a = min(b, n // 2)
    extra = n - 2 * a
    lens = [1 + extra // a + (i < extra % a) for i in range(a)]
    return lens + [-1] * (b - a)


@dataclass(frozen=True)
class FixedLengths:
    """A ragged-engine policy that verifies lengths[b] drafts in row b every round."""

    lengths: tuple[int, ...]

    def __call__(self, conf_BxK, active_B, useful_B) -> jax.Array:
        return jnp.asarray(self.lengths, jnp.int32)


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
    verify: Verify = "padded",
    sizes: tuple[int, ...] | None = None,
) -> CostTable | RaggedCost:
    """The round-cost table saved with the drafter run for this batch size and the target's
    context length S = `target_cfg.max_seq_len` (a round reads the whole KV cache, so its cost
    depends on S: `with_context_len`), measured on first use (`loop_round_cost_b{B}_s{S}.json`,
    or `ragged_round_cost_b{B}_s{S}.json` for verify "ragged"; delete it to re-measure on
    another machine). Measuring compiles and times a decode per
    width (packed size) and pass (`rounds`, `passes`: `measure_round_cost`); it says so on
    stderr and shows `progress`. `sizes`: the packed sizes to time (ragged)."""
    name = "ragged_round_cost" if verify == "ragged" else "loop_round_cost"
    path = os.path.join(drafter_workdir, f"{name}_b{batch_size}_s{target_cfg.max_seq_len}.json")
    if os.path.exists(path):
        return RaggedCost.load(path) if verify == "ragged" else CostTable.load(path)
    what = "packed sizes" if verify == "ragged" else f"verify widths 0..{drafter.block_size}"
    print(
        f"measuring the decode-round cost at {what} for batch {batch_size} (once per drafter "
        f"and batch size; saved to {path})",
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
        verify=verify,
        sizes=sizes,
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
