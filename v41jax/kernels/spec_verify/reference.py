"""Plain-jnp reference of speculative verification with supplied randomness.

Shapes: B rows, K drafts, V vocabulary.
  draft_tokens  int32 [B, K]       d_j, the drafted ids
  draft_probs   float [B, K, V]    q_j, the law d_j was drawn from; None = one-hot at d_j
  target_probs  float [B, K+1, V]  p_j, the target law at position j (j = K: bonus)
  verify_len    int32 [B]          L in [0, K]: only d_0 .. d_{L-1} are verified
  accept_u      float [B, K]       u_j ~ U[0, 1), one per draft
  race_u        float [B, V]       w_v ~ U[0, 1), one per vocabulary entry (one row per row)

Rule (Leviathan et al. 2023), all arithmetic in float32:
  accept d_j  iff  j < L  and  u_j q_j(d_j) < p_j(d_j)       (i.e. u_j < p_j(d_j)/q_j(d_j))
  A = number of leading accepted drafts (num_accepted), in [0, L]
  r = max(0, p_A - q_A)  if A < L  (first rejection)
    = p_A                if A = L  (all verified drafts accepted: the bonus token)
  if sum(r) = 0 (a residual with no mass, only reachable with q_A(d_A) = 0): r = p_A
  token = argmin_v  E_v / r_v  over r_v > 0,   E_v = -log(1 - w_v) ~ Exp(1)
The exponential race picks v with probability r_v / sum(r): E_v / r_v ~ Exp(rate r_v) and
the smallest of independent exponentials is v with probability rate_v / sum of rates. So
the residual needs no normalisation, and one race row per batch row suffices because only
the row at A is ever sampled.
Output: out_tokens int32 [B, K+1] = (d_0, .., d_{A-1}, token, -1, .., -1), num_accepted [B].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def draft_token_probs(
    draft_tokens_BxK: jax.Array, draft_probs_BxKxV: jax.Array | None, target_probs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(p_j(d_j), q_j(d_j)) float32 [B, K]; q_j(d_j) = 1 for one-hot (None) drafts."""
    k = draft_tokens_BxK.shape[1]
    rows = jnp.arange(k)

    # Index the full arrays per row: slicing target_probs[:, :K] first makes XLA copy it.
    def pick(x_RxV, d_K):
        return x_RxV[rows, d_K].astype(jnp.float32)

    p_d = jax.vmap(pick)(target_probs, draft_tokens_BxK)
    if draft_probs_BxKxV is None:
        return p_d, jnp.ones_like(p_d)
    return p_d, jax.vmap(pick)(draft_probs_BxKxV, draft_tokens_BxK)


def count_accepted(
    p_d_BxK: jax.Array, q_d_BxK: jax.Array, accept_u_BxK: jax.Array, verify_len_B: jax.Array
) -> jax.Array:
    """A: leading drafts with j < L and u_j q_j(d_j) < p_j(d_j), int32 [B]."""
    k = p_d_BxK.shape[1]
    ok = accept_u_BxK.astype(jnp.float32) * q_d_BxK < p_d_BxK
    ok &= jnp.arange(k, dtype=jnp.int32) < verify_len_B[:, None]
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def residual_weights(p_a: jax.Array, q_a: jax.Array, rejected: jax.Array) -> jax.Array:
    """The law of the token after A accepted drafts, unnormalised, float32 [..., V]:
    max(0, p_A - q_A) at a rejection (`rejected` [...]), p_A for the bonus, and p_A again
    when the residual has no mass."""
    residual = jnp.where(rejected[..., None], jnp.maximum(p_a - q_a, 0.0), p_a)
    return jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), residual, p_a)


def race_keys(residual_BxV: jax.Array, race_u_BxV: jax.Array) -> jax.Array:
    """E_v / r_v (+inf where r_v = 0), float32 [B, V]; the argmin is the race winner."""
    e = -jnp.log1p(-race_u_BxV.astype(jnp.float32))
    safe = jnp.where(residual_BxV > 0, residual_BxV, 1.0)
    return jnp.where(residual_BxV > 0, e / safe, jnp.inf)


def assemble_output(
    draft_tokens_BxK: jax.Array, num_accepted_B: jax.Array, token_B: jax.Array
) -> jax.Array:
    """(d_0 .. d_{A-1}, token, -1 ...) int32 [B, K+1]."""
    b, k = draft_tokens_BxK.shape
    pos = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    drafts = jnp.concatenate([draft_tokens_BxK, jnp.zeros((b, 1), jnp.int32)], axis=1)
    a = num_accepted_B[:, None]
    out = jnp.where(pos < a, drafts, jnp.where(pos == a, token_B[:, None], -1))
    return out.astype(jnp.int32)


def spec_verify_reference(
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    verify_len: jax.Array,
    accept_u: jax.Array,
    race_u: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """(out_tokens int32 [B, K+1], num_accepted int32 [B]); see the module docstring."""
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    draft_tokens = draft_tokens.astype(jnp.int32)
    verify_len = verify_len.astype(jnp.int32)
    p_d, q_d = draft_token_probs(draft_tokens, draft_probs, target_probs)
    num_accepted = count_accepted(p_d, q_d, accept_u, verify_len)

    row = num_accepted[:, None, None]
    p_a = jnp.take_along_axis(target_probs, row, axis=1)[:, 0].astype(jnp.float32)
    if draft_probs is None:
        d_a = jnp.take_along_axis(draft_tokens, jnp.minimum(num_accepted, k - 1)[:, None], 1)
        q_a = jax.nn.one_hot(d_a[:, 0], v, dtype=jnp.float32) if k > 0 else jnp.zeros_like(p_a)
    else:
        q_rows = jnp.concatenate([draft_probs, jnp.zeros((b, 1, v), draft_probs.dtype)], 1)
        q_a = jnp.take_along_axis(q_rows, row, axis=1)[:, 0].astype(jnp.float32)
    residual = residual_weights(p_a, q_a, num_accepted < verify_len)
    token = jnp.argmin(race_keys(residual, race_u), axis=-1).astype(jnp.int32)
    return assemble_output(draft_tokens, num_accepted, token), num_accepted
