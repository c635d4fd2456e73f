"""The DSpark Markov head (REFERENCE.md §4): a low-rank transition bias between consecutive
draft tokens, added to the drafter's parallel base logits. Pure functions, no Linen.

With base logits b_k [V] for draft position k = 1..K (one parallel drafter forward), the
anchor x_0 (the last token the target accepted) and the previous draft x_{k-1}:

    logits_k(v) = b_k(v) + u(x_{k-1}) . w(v),        q_k(v) ∝ exp(logits_k(v))

before the sampling transform (temperature, top-k, ...), with u, w the rows of the [V, r]
tables `markov_params = {"u": u_Vxr, "w": w_Vxr}`. The bias is the only sequential part of
drafting: the transformer runs once per round, then K cheap steps of this head sample
x_1 .. x_K (`markov_draft`). Training uses the same equation teacher-forced on the true
previous token (`teacher_forced_logits`), so the trained and the sampled q agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

MarkovParams = Mapping[str, jax.Array]
ProbsFn = Callable[[jax.Array], jax.Array]


def check_token_range(name: str, tokens: jax.Array, vocab_size: int) -> None:
    """Raise ValueError if a concrete token array has ids outside [0, vocab_size).

    Traced values cannot be checked and are let through (an out-of-range id would then be
    clamped by the gather, silently reading another token's row)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(
            f"{name} must be token ids in [0, {vocab_size}); got min={t.min()}, max={t.max()}"
        )


def _check_markov_params(markov_params: MarkovParams) -> tuple[int, int]:
    """(V, r) of a valid {"u": [V, r], "w": [V, r]}; ValueError otherwise."""
    if set(markov_params) != {"u", "w"}:
        raise ValueError(f"markov_params must have keys {{'u', 'w'}}; got {sorted(markov_params)}")
    u, w = markov_params["u"], markov_params["w"]
    if u.ndim != 2 or u.shape != w.shape:
        raise ValueError(
            f"markov_params u {tuple(u.shape)} and w {tuple(w.shape)} must both be [V, r]"
        )
    return u.shape[0], u.shape[1]


def markov_bias(markov_params: MarkovParams, prev_tokens: jax.Array) -> jax.Array:
    """Transition bias `bias(v) = u(prev) . w(v)`: int [...] -> float32 [..., V].

    The rank-r product runs at HIGHEST precision in float32 so that the q the drafter samples
    from and the q recomputed for verification or training agree to float32 rounding
    whatever the leading shape (no TF32 / bf16 passes on accelerators).
    """
    vocab, _ = _check_markov_params(markov_params)
    check_token_range("prev_tokens", prev_tokens, vocab)
    u_Vxr = markov_params["u"].astype(jnp.float32)
    w_Vxr = markov_params["w"].astype(jnp.float32)
    u_prev = jnp.take(u_Vxr, prev_tokens, axis=0)
    return jnp.einsum("...r,vr->...v", u_prev, w_Vxr, precision=jax.lax.Precision.HIGHEST)


def teacher_forced_logits(
    base_logits_BxNxKxV: jax.Array,
    markov_params: MarkovParams | None,
    anchors_BxN: jax.Array,
    next_tokens_BxNxK: jax.Array,
) -> jax.Array:
    """Drafter logits with the Markov term on given previous tokens, float32 [B, N, K, V].

    `logits[..., k, :] = base[..., k, :] + u(x_{k-1}) . w` with x_0 = the anchor and
    x_k = next_tokens[..., k - 1] (k = 1..K-1; next_tokens[..., K-1] is not read). In training
    x_k are the true continuation tokens; for verification they are the sampled drafts, which
    reproduces exactly the q each draft was sampled from. `markov_params` None -> base.
    """
    base = base_logits_BxNxKxV.astype(jnp.float32)
    if base.ndim != 4:
        raise ValueError(f"base_logits must be [B, N, K, V]; got shape {tuple(base.shape)}")
    b, n, k, v = base.shape
    if anchors_BxN.shape != (b, n) or next_tokens_BxNxK.shape != (b, n, k):
        raise ValueError(
            f"anchors {tuple(anchors_BxN.shape)} and next_tokens "
            f"{tuple(next_tokens_BxNxK.shape)} must be [B, N] = {(b, n)} and "
            f"[B, N, K] = {(b, n, k)} for base_logits {tuple(base.shape)}"
        )
    if markov_params is None:
        return base
    vocab, _ = _check_markov_params(markov_params)
    if vocab != v:
        raise ValueError(f"markov_params vocab {vocab} != base_logits vocab {v}")
    check_token_range("anchors", anchors_BxN, v)
    check_token_range("next_tokens", next_tokens_BxNxK, v)
    prev_BxNxK = jnp.concatenate(
        [anchors_BxN[..., None], next_tokens_BxNxK[..., :-1]], axis=-1
    ).astype(jnp.int32)
    return base + markov_bias(markov_params, prev_BxNxK)


def markov_draft(
    key: jax.Array,
    base_logits_BxKxV: jax.Array,
    anchors_B: jax.Array,
    markov_params: MarkovParams | None,
    probs_fn: ProbsFn,
) -> tuple[jax.Array, jax.Array]:
    """Sample K drafts sequentially through the Markov head: (drafts int32 [B, K],
    q float32 [B, K, V]).

    For k = 1..K: `q_k = probs_fn(base_k + u(x_{k-1}) . w)`, i.e.
    q_k(v) ∝ exp(base_k(v) + u(x_{k-1}) · w(v)) before the sampling transform, and
    x_k ~ q_k with an independent key per step (x_0 = the anchor). `probs_fn` maps float32
    logits [B, V] to probabilities [B, V] (e.g. `functools.partial(sampling_probs,
    temperature=...)`; temperature 0 gives the greedy argmax chain). The returned q is
    exactly the distribution each draft was drawn from (the verifier's q); a draft never has
    q = 0 because it is drawn from log q. The transformer is not re-run: only this O(r V)
    head is sequential.
    """
    base = base_logits_BxKxV.astype(jnp.float32)
    if base.ndim != 3:
        raise ValueError(f"base_logits must be [B, K, V]; got shape {tuple(base.shape)}")
    b, k, v = base.shape
    if anchors_B.shape != (b,):
        raise ValueError(f"anchors shape {tuple(anchors_B.shape)} != [B] = {(b,)}")
    check_token_range("anchors", anchors_B, v)
    if markov_params is not None:
        vocab, _ = _check_markov_params(markov_params)
        if vocab != v:
            raise ValueError(f"markov_params vocab {vocab} != base_logits vocab {v}")

    def step(prev_B, inputs):
        key_k, base_BxV = inputs
        logits_BxV = base_BxV
        if markov_params is not None:
            logits_BxV = logits_BxV + markov_bias(markov_params, prev_B)
        q_BxV = probs_fn(logits_BxV).astype(jnp.float32)
        x_B = jax.random.categorical(key_k, jnp.log(q_BxV), axis=-1).astype(jnp.int32)
        return x_B, (x_B, q_BxV)

    keys_K = jax.random.split(key, k)
    _, (drafts_KxB, q_KxBxV) = jax.lax.scan(
        step, anchors_B.astype(jnp.int32), (keys_K, jnp.swapaxes(base, 0, 1))
    )
    return drafts_KxB.T, jnp.swapaxes(q_KxBxV, 0, 1)
