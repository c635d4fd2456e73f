"""The exact speculative sampler: accept drafts, then one token from the residual or bonus.

The rule, its proof and the expected-tokens derivation, with examples: docs/speculative.md.

Rule (Leviathan et al. 2023, Chen et al. 2023). Draft x ~ q; accept it if
u < p(x)/q(x), computed as `u q(x) < p(x)` in float32 with u ~ U[0, 1); on rejection emit
one token from r = max(0, p - q) / sum(max(0, p - q)) and stop; if all verified drafts are
accepted, emit a bonus token from the next target distribution.

Why the output is distributed as p (one position; the next ones follow by induction, since
each emitted token is drawn from p given everything emitted before, and a round only goes
on to position j+1 after emitting an exact sample at j):

    P(emit x) = P(draft x, accept) + P(reject) r(x)
              = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x)
              = min(p(x), q(x)) + sum_y max(0, p(y) - q(y)) * max(0, p(x) - q(x)) / sum_y ..
              = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x),

using 1 - sum min(p, q) = sum max(0, p - q) (both p and q sum to 1). The acceptance
probability at one position is beta = sum_x min(p(x), q(x)) = 1 - TV(p, q); the number of
accepted drafts A has P(A >= j) = prod_{i<j} beta_i, so E[tokens per round] =
1 + sum_{j=1..K} prod_{i<=j} beta_i (see `throughput.py`). Deterministic (argmax) drafts
are the case q = one-hot(x): accept with probability p(x), residual = p with p(x) removed.
The rule is exact only if q is the law the draft was really sampled from (same
temperature, top-k/top-p/min-p, dtype) — `v41jax.speculative.audit_verifier` checks a verifier.

Implementations (`impl`):
  "xla"        the fast path. Gathers p_j(d_j) and q_j(d_j) (B K elements), counts the
               accepted prefix A, then reads only the rows p_A and q_A: one residual per
               row is ever needed. The token is drawn by inverse CDF with one uniform per
               row, two-level (block sums, then a cumsum inside the chosen block) so that
               no [B, V] random numbers and no full-length scan are needed. Rows go 8 at
               a time so their few passes stay in cache.
  "reference"  `spec_verify_reference` on uniforms drawn from `key`: an exponential race
               over the residual row (reads every row, draws B V uniforms).
  "pallas"     the fused kernel (`v41jax.kernels.spec_verify`), one pass over all rows;
               equal to "reference" given the same key (interpret mode on CPU).
All three are exact; "reference" and "pallas" give identical tokens for the same key, "xla"
a different (equally distributed) draw.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from v41jax.kernels.spec_verify import spec_verify
from v41jax.kernels.spec_verify.reference import (
    assemble_output,
    count_accepted,
    draft_token_probs,
    residual_weights,
)

IMPLS = ("xla", "reference", "pallas")
# Inverse-CDF block width: V / 256 block sums are scanned, then one 256-wide block.
_CDF_BLOCK = 256
# Rows sampled together by the fast path (see _verify_xla).
_ROWS_PER_CHUNK = 8
# Tolerance of the eager normalisation check (bf16 probabilities carry ~3 digits).
_SUM_TOL = {"float32": 1e-3, "float64": 1e-6, "bfloat16": 2e-2, "float16": 5e-3}


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def check_speculative_inputs(draft_tokens, draft_probs, target_probs, verify_len) -> None:
    """Raise ValueError naming the bad value. Shapes and dtypes are always checked; values
    (ids in [0, V), verify_len in [0, K], probabilities >= 0 summing to 1) when concrete."""
    if np.ndim(draft_tokens) != 2 or not jnp.issubdtype(jnp.result_type(draft_tokens), jnp.integer):
        raise ValueError(
            f"draft_tokens must be an integer [B, K] array, got shape {np.shape(draft_tokens)} "
            f"dtype {jnp.result_type(draft_tokens)}"
        )
    b, k = np.shape(draft_tokens)
    tp_shape = np.shape(target_probs)
    if len(tp_shape) != 3 or tp_shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [B={b}, K+1={k + 1}, V], got shape {tp_shape}")
    v = tp_shape[2]
    arrays = {"target_probs": target_probs}
    if draft_probs is not None:
        if np.shape(draft_probs) != (b, k, v):
            raise ValueError(
                f"draft_probs must be [B={b}, K={k}, V={v}] or None, got {np.shape(draft_probs)}"
            )
        arrays["draft_probs"] = draft_probs
    for name, x in arrays.items():
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"{name} must be floating point, got {jnp.result_type(x)}")
    if np.shape(verify_len) != (b,):
        raise ValueError(f"verify_len must have shape ({b},), got {np.shape(verify_len)}")
    if not jnp.issubdtype(jnp.result_type(verify_len), jnp.integer):
        raise ValueError(f"verify_len must be integer, got {jnp.result_type(verify_len)}")
    if not _is_concrete(draft_tokens, draft_probs, target_probs, verify_len):
        return
    d = np.asarray(draft_tokens)
    if d.size and (d.min() < 0 or d.max() >= v):
        bad = d[(d < 0) | (d >= v)]
        raise ValueError(f"draft_tokens {bad[:8].tolist()} outside the vocabulary [0, {v})")
    vl = np.asarray(verify_len)
    if vl.size and (vl.min() < 0 or vl.max() > k):
        raise ValueError(f"verify_len {vl.tolist()} must lie in [0, K={k}]")
    for name, x in arrays.items():
        tol = _SUM_TOL.get(jnp.dtype(x.dtype).name, 1e-3)
        x = np.asarray(x, np.float64)
        if not np.all(np.isfinite(x)) or x.min() < 0:
            raise ValueError(f"{name} must be finite and >= 0 (min {np.nanmin(x)})")
        sums = x.sum(axis=-1)
        worst = np.unravel_index(np.argmax(np.abs(sums - 1)), sums.shape)
        if abs(sums[worst] - 1) > tol:
            raise ValueError(
                f"{name}{list(worst)} sums to {sums[worst]:.6g}, not 1 (tolerance {tol}): "
                "pass normalised probabilities (e.g. `sampling_probs`), not logits or weights"
            )


def sample_inverse_cdf(weights_BxV: jax.Array, u_B: jax.Array, block: int = _CDF_BLOCK):
    """One index per row with P(v) = w_v / sum(w), int32 [B]; w >= 0 with sum > 0.

    t = u sum(w); the block is the first whose cumulative block sum exceeds t, then the
    index is the first in that block whose cumulative sum exceeds the rest of t. A zero
    weight can never be picked (its cumulative sum equals its predecessor's); where float
    rounding overshoots, the last positive entry is taken. Never returns an id >= V.
    """
    b, v = weights_BxV.shape
    nb = -(-v // block)
    w = jnp.pad(weights_BxV.astype(jnp.float32), ((0, 0), (0, nb * block - v)))
    w3 = w.reshape(b, nb, block)
    block_sums = jnp.sum(w3, axis=-1)
    block_cum = jnp.cumsum(block_sums, axis=-1)
    t = u_B.astype(jnp.float32) * block_cum[:, -1]

    def last_positive(mask_BxN):
        idx = jnp.arange(mask_BxN.shape[-1], dtype=jnp.int32)
        return jnp.max(jnp.where(mask_BxN, idx, -1), axis=-1)

    blk = jnp.sum(block_cum <= t[:, None], axis=-1).astype(jnp.int32)
    blk = jnp.where(blk < nb, blk, last_positive(block_sums > 0))
    before = jnp.take_along_axis(block_cum - block_sums, blk[:, None], axis=1)[:, 0]
    inner_w = jnp.take_along_axis(w3, blk[:, None, None], axis=1)[:, 0]
    inner_cum = jnp.cumsum(inner_w, axis=-1)
    pos = jnp.sum(inner_cum <= (t - before)[:, None], axis=-1).astype(jnp.int32)
    pos = jnp.where(pos < block, pos, last_positive(inner_w > 0))
    return jnp.clip(blk * block + jnp.maximum(pos, 0), 0, v - 1)


def _verify_xla(key, draft_tokens, draft_probs, target_probs, verify_len):
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    k_accept, k_row = jax.random.split(key)
    accept_u = jax.random.uniform(k_accept, (b, k), jnp.float32)
    row_u = jax.random.uniform(k_row, (b,), jnp.float32)
    p_d, q_d = draft_token_probs(draft_tokens, draft_probs, target_probs)
    num_accepted = count_accepted(p_d, q_d, accept_u, verify_len)

    def sample_row(args):
        """Only the row at A is ever sampled: read p_A and q_A, not all K + 1 rows."""
        p_rows, q_rows, d_row, a, length, u = args
        p_a = lax.dynamic_index_in_dim(p_rows, a, 0, keepdims=False).astype(jnp.float32)
        if q_rows is None:  # one-hot drafts: q_A = one_hot(d_A)
            d_a = lax.dynamic_index_in_dim(d_row, jnp.minimum(a, k - 1), 0, keepdims=False)
            q_a = (jnp.arange(v) == d_a).astype(jnp.float32)
        else:
            q_a = lax.dynamic_index_in_dim(q_rows, jnp.minimum(a, k - 1), 0, keepdims=False)
        residual = residual_weights(p_a, q_a.astype(jnp.float32), a < length)
        return sample_inverse_cdf(residual[None], u[None])[0]

    # A few rows at a time, so the rows' passes (residual, mass check, block sums, search)
    # hit cache instead of streaming all B rows of V through memory once per pass.
    token = lax.map(
        sample_row,
        (target_probs, draft_probs, draft_tokens, num_accepted, verify_len, row_u),
        batch_size=_ROWS_PER_CHUNK,
    )
    return assemble_output(draft_tokens, num_accepted, token), num_accepted


@functools.partial(jax.jit, static_argnames=("impl",))
def _speculative_sample(key, draft_tokens, draft_probs, target_probs, verify_len, *, impl):
    draft_tokens = draft_tokens.astype(jnp.int32)
    verify_len = verify_len.astype(jnp.int32)
    if draft_tokens.shape[1] == 0:  # K = 0: plain sampling from p_0
        u = jax.random.uniform(key, (draft_tokens.shape[0],), jnp.float32)
        token = sample_inverse_cdf(target_probs[:, 0].astype(jnp.float32), u)
        return token[:, None], jnp.zeros_like(verify_len)
    if impl == "xla":
        return _verify_xla(key, draft_tokens, draft_probs, target_probs, verify_len)
    k_accept, k_race = jax.random.split(key)
    b, k = draft_tokens.shape
    accept_u = jax.random.uniform(k_accept, (b, k), jnp.float32)
    race_u = jax.random.uniform(k_race, (b, target_probs.shape[-1]), jnp.float32)
    kernel_impl = "pallas" if impl == "pallas" else "reference"
    return spec_verify(
        draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u, impl=kernel_impl
    )


def speculative_sample(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    verify_len: jax.Array | None = None,
    *,
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Verify K drafts per row against the target and emit the round's tokens.

    key: a PRNG key. draft_tokens int [B, K]; draft_probs float [B, K, V], the q the drafts
    were sampled from, or None for deterministic (argmax) drafts (q = one-hot);
    target_probs float [B, K+1, V]; verify_len int [B] in [0, K] (default K): only the
    first verify_len[b] drafts of row b are verified.
    Returns (out_tokens int32 [B, K+1]: the accepted drafts, one sampled token, then -1;
    num_accepted int32 [B] in [0, verify_len]). Rows are independent; float32 arithmetic
    whatever the input dtype; jit-able (inputs are value-checked only when concrete).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if verify_len is None:
        verify_len = jnp.full((np.shape(draft_tokens)[0],), np.shape(draft_tokens)[-1], jnp.int32)
    check_speculative_inputs(draft_tokens, draft_probs, target_probs, verify_len)
    return _speculative_sample(
        key,
        jnp.asarray(draft_tokens),
        None if draft_probs is None else jnp.asarray(draft_probs),
        jnp.asarray(target_probs),
        jnp.asarray(verify_len),
        impl=impl,
    )
