"""Batched DSpark speculative decoding with per-round verify widths (DeepSeek-V4.1 report).

The round (`v41jax.dspark.rounds`): draft K tokens in one drafter pass plus the Markov head,
choose the verify width w from draft-side information only, verify [pending, d_1 .. d_w] with
the target, `speculative_sample`. Two loops drive it:

- device (mode "fixed", the default loop): the whole generation is one `lax.while_loop` at
  the static width;
- host (mode "scheduled", or `loop="host"`): a Python loop over segments, one compiled
  program per width that runs rounds while the scheduler keeps choosing that width (a
  `lax.while_loop`), caches donated from call to call. At a change the width is read back
  and the matching program is dispatched, so each width costs what it costs. (A
  `lax.switch` over the widths inside the device loop carries the KV caches through the
  conditional and XLA copies them in and out on every round.)

The scheduler trades expected tokens against the measured cost of a whole round at each width,
timed inside the loop (`measure_round_cost`): the drafter pass, the Markov sampling and the
context write are paid whatever w is, so a verify-only table would overstate what a longer
verify costs.
Greedy (temperature 0) output equals plain greedy decoding token for token.
Requirement: max(prompt length) + max_new_tokens + 2K + 1 <= target max_seq_len.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from tqdm.auto import tqdm

from v41jax.config import ModelConfig
from v41jax.dspark.config import DrafterConfig
from v41jax.dspark.drafter import FrozenTarget, frozen_target
from v41jax.dspark.rounds import (
    Ctx,
    Draft,
    State,
    Static,
    any_active,
    draft_step,
    prefill,
    verify_step,
)
from v41jax.dspark.scheduler import CostTable
from v41jax.model.generate import _check_compression
from v41jax.model.sampling import Scalar, sampling_knobs
from v41jax.model.speculative import check_prompt_batch

MODES = ("fixed", "scheduled")
LOOPS = ("auto", "device", "host")


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


def check_dspark_args(
    target_cfg: ModelConfig,
    drafter: DrafterConfig,
    prompt_shape,
    lengths,
    n_new: int,
    mode: str,
    verify_len: int | None,
    loop: str = "auto",
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
    mode: str = "fixed",
    verify_len: int | None = None,
    cost: CostTable | None = None,
    temperature: Scalar = 0.0,
    top_k: Scalar = 0,
    top_p: Scalar = 1.0,
    min_p: Scalar = 0.0,
    rng: jax.Array | None = None,
    compression: Any = None,
    loop: str = "auto",
) -> DSparkOutput:
    """Continue each right-padded prompt by `max_new_tokens` tokens with DSpark drafts.

    mode "fixed" verifies `verify_len` (default K) drafts per row per round; "scheduled"
    chooses each round's width from the confidences and `cost` (required; a round-cost table
    from `measure_round_cost`). loop "auto" is "device" for fixed, "host" for scheduled; both
    loops give the same tokens for the same rng. The output is distributed exactly as
    `generate(target_params, ...)` with the same sampling settings.
    """
    shape = tuple(np.shape(prompt_tokens_BxP))
    check_dspark_args(
        target_cfg, drafter, shape, prompt_lengths_B, max_new_tokens, mode, verify_len, loop
    )
    if mode == "scheduled" and cost is None:
        raise ValueError("mode='scheduled' needs the engine's round cost table (cost=...)")
    if cost is not None and not isinstance(cost, CostTable):
        raise ValueError(f"cost must be a CostTable, got {type(cost).__name__}")
    knobs = sampling_knobs(temperature, top_k, top_p, min_p)
    _check_compression(target_cfg, compression)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
    c = Ctx(
        nn.unbox(target_params),
        nn.unbox(drafter_params),
        frozen,
        knobs,
        compression,
        lengths + max_new_tokens,
    )
    st = Static(
        target_cfg,
        drafter,
        max_new_tokens,
        mode,
        verify_len or drafter.block_size,
        cost if mode == "scheduled" else None,
    )
    prompts = jnp.asarray(prompt_tokens_BxP, jnp.int32)
    rng = jax.random.key(0) if rng is None else rng
    if loop == "host" or (loop == "auto" and mode == "scheduled"):
        return _host_generate(c, prompts, lengths, rng, st)
    return _device_generate(c, prompts, lengths, rng, st)


def _finish(lengths_B, state: State, st: Static) -> DSparkOutput:
    c_log, l_log, a_log, act_log = state.logs
    idx = lengths_B[:, None] + jnp.arange(st.max_new_tokens)
    tokens = jnp.take_along_axis(state.history, idx, axis=1)
    rounds = act_log.sum(0).astype(jnp.int32)
    return DSparkOutput(tokens, rounds, c_log, l_log, a_log, act_log)


@functools.partial(jax.jit, static_argnames=("st",))
def _device_generate(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> DSparkOutput:
    def one_round(state):
        return verify_step(c, state, draft_step(c, state, st), st, st.fixed_len)

    state = prefill(c, prompts_BxP, lengths_B, rng, st)
    state = jax.lax.while_loop(lambda s: any_active(c, s), one_round, state)
    return _finish(lengths_B, state, st)


_finish_jit = jax.jit(_finish, static_argnames=("st",))


def _flags(c: Ctx, state: State, d: Draft) -> jax.Array:
    """[next width, any row active]: the two ints the host reads."""
    return jnp.stack([d.width, any_active(c, state).astype(jnp.int32)])


def _with_flags(c: Ctx, state: State, st: Static):
    """The round's draft side and its `_flags`."""
    d = draft_step(c, state, st)
    return state, d, _flags(c, state, d)


@functools.partial(jax.jit, static_argnames=("st",))
def _host_start(c: Ctx, prompts_BxP, lengths_B, rng, st: Static):
    return _with_flags(c, prefill(c, prompts_BxP, lengths_B, rng, st), st)


# One program per round and width: this round's verify, then the next round's draft (one
# launch per round: the reference `_host_segment` is tested against). The state (both KV
# caches, history, logs) is donated: updated in place.
@functools.partial(jax.jit, static_argnames=("st", "width"), donate_argnames=("state",))
def _host_step(c: Ctx, state: State, d: Draft, st: Static, width: int):
    return _with_flags(c, verify_step(c, state, d, st, width), st)


# One program per width that keeps going while the scheduler keeps choosing that width: a run
# of rounds at one width costs one launch and one sync, not one per round (with the width
# stable, the host loop runs as fast as the fused device loop).
@functools.partial(jax.jit, static_argnames=("st", "width"), donate_argnames=("state",))
def _host_segment(c: Ctx, state: State, d: Draft, st: Static, width: int):
    def same_width(carry):
        state, d = carry
        return any_active(c, state) & (d.width == width)

    def one_round(carry):
        state, d = carry
        state = verify_step(c, state, d, st, width)
        return state, draft_step(c, state, st)

    state, d = jax.lax.while_loop(same_width, one_round, (state, d))
    return state, d, _flags(c, state, d)


def _host_generate(c: Ctx, prompts_BxP, lengths_B, rng, st: Static) -> DSparkOutput:
    """Segments of rounds at one width until every row is done; the draft after the last
    round is computed and discarded (one drafter pass). Each call donates its state."""
    state, d, flags = _host_start(c, prompts_BxP, lengths_B, rng, st)
    while True:
        width, more = (int(x) for x in jax.device_get(flags))
        if not more:
            return _finish_jit(lengths_B, state, st)
        state, d, flags = _host_segment(c, state, d, st, width)


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
    temperature: float = 1.0,
    compression: Any = None,
    progress: bool = False,
) -> CostTable:
    """Seconds of one decode round at each verify width w = 1 .. K, B rows, as the loop runs
    it: the drafter pass, Markov sampling, the target's verify of w + 1 tokens per row, the
    acceptance rule and the context write. Per pass and width: a fresh prefill, then a whole
    decode of `rounds` (K + 1) new tokens at width w as one `_host_segment` (the program the
    scheduled loop runs), timed and divided by the rounds it ran (>= `rounds`; default 16 or
    as many as max_seq_len holds). The first pass also compiles and is discarded; the cost is
    the min over the other `passes`.

    Timed inside the loop on purpose: a launch and a sync per round add a fixed cost to every
    width that flattens the table and hides that short widths are cheaper. `progress` shows
    a bar over the (passes + 1) x K timed decodes. Returns CostTable(tokens = B (1 + w),
    seconds), the table `schedule_verify_lengths(basis="width")` reads."""
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
    knobs = sampling_knobs(temperature, 0, 1.0, 0.0)
    if compression is not None:
        compression = jnp.asarray(compression, jnp.int32)
    c = Ctx(nn.unbox(target_params), nn.unbox(drafter_params), frozen, knobs, compression,
            lengths + n_new)  # fmt: skip
    prompts = jnp.zeros((b, 1), jnp.int32)
    tick = time.get_clock_info("perf_counter").resolution

    def seconds_per_round(w: int, p: int) -> float:
        st = Static(target_cfg, drafter, n_new, "fixed", w, None)
        state, d, _ = jax.block_until_ready(_host_start(c, prompts, lengths, jax.random.key(p), st))
        r0 = int(state.r)
        start = time.perf_counter()
        state, _, _ = jax.block_until_ready(_host_segment(c, state, d, st, w))
        elapsed = time.perf_counter() - start
        return max(elapsed, tick) / (int(state.r) - r0)

    best = [float("inf")] * k
    bar = tqdm(total=(passes + 1) * k, desc="timing verify widths", disable=not progress)
    for p in range(passes + 1):  # pass 0 compiles
        widths = list(range(1, k + 1))[:: 1 if p % 2 == 0 else -1]  # alternate: drift
        for w in widths:
            secs = seconds_per_round(w, p)
            if p:
                best[w - 1] = min(best[w - 1], secs)
            bar.update(1)
    bar.close()
    return CostTable(tuple(b * (1 + w) for w in range(1, k + 1)), tuple(best))


def load_or_measure_cost(
    drafter_workdir: str,
    target_params,
    target_cfg: ModelConfig,
    drafter_params,
    drafter: DrafterConfig,
    batch_size: int,
    compression: Any = None,
    progress: bool = True,
) -> CostTable:
    """The round-cost table saved with the drafter run for this batch size, measured on first
    use (`loop_round_cost_b{B}.json`; delete it to re-measure on another machine). Measuring
    compiles and times K decodes per pass; it says so on stderr and shows `progress`."""
    path = os.path.join(drafter_workdir, f"loop_round_cost_b{batch_size}.json")
    if os.path.exists(path):
        return CostTable.load(path)
    print(
        f"measuring the decode-round cost at verify widths 1..{drafter.block_size} for batch "
        f"{batch_size} (once per drafter and batch size; saved to {path})",
        file=sys.stderr,
    )
    frozen = frozen_target(target_params, target_cfg)
    cost = measure_round_cost(
        target_params, target_cfg, drafter_params, drafter, frozen, batch_size,
        compression=compression, progress=progress,
    )  # fmt: skip
    cost.save(path)
    return cost
