"""The DSpark Markov head (DeepSeek-V4.1 report): a low-rank transition bias between consecutive
draft tokens, added to the drafter's parallel base logits. Pure functions, no Linen.

With base logits b_k [V] for draft position k = 1..K (one parallel drafter forward), the
anchor x_0 (the last token the target accepted) and the previous draft x_{k-1}:

    logits_k(v) = b_k(v) + u(x_{k-1}) . w(v),        q_k(v) ∝ exp(logits_k(v))

before the sampling transform (temperature, top-k, ...), with u, w the rows of the [V, r]
tables `markov_params = {"u": u_Vxr, "w": w_Vxr}`.

Contextual variant (`DrafterConfig.markov_context = H > 0`; params also hold t [V, H],
h [D, H], o [H, r]): the transition vector also reads draft position k's hidden state
hidden_k [D] from the drafter's one parallel pass,

    u_k = u(x_{k-1}) + gelu(hidden_k h + t(x_{k-1})) o,     logits_k(v) = b_k(v) + u_k . w(v)

so how strongly x_{k-1} steers draft k depends on the context (a plain bigram bias cannot:
after "of" the next word depends on what came before). o starts at zero, so an untrained
contextual head is the plain one. Still O(H D + r V) per step, no transformer pass.

The bias is the only sequential part of drafting: the transformer runs once per round, then
K cheap steps of this head sample x_1 .. x_K (`markov_draft`). Training uses the same
equation teacher-forced on the true previous token (`teacher_forced_logits`), so the
trained and the sampled q agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.decode.sampling import sample_probs

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


PLAIN_KEYS, CONTEXT_KEYS = {"u", "w"}, {"u", "w", "t", "h", "o"}


def is_contextual(markov_params: MarkovParams) -> bool:
    return set(markov_params) == CONTEXT_KEYS


def _check_markov_params(markov_params: MarkovParams) -> tuple[int, int]:
    """(V, r) of valid params: {"u", "w": [V, r]}, plus {"t": [V, H], "h": [D, H],
    "o": [H, r]} for the contextual head; ValueError otherwise."""
    keys = set(markov_params)
    if keys not in (PLAIN_KEYS, CONTEXT_KEYS):
        raise ValueError(
            f"markov_params must have keys {sorted(PLAIN_KEYS)} or {sorted(CONTEXT_KEYS)}; "
            f"got {sorted(keys)}"
        )
    u, w = markov_params["u"], markov_params["w"]
    if u.ndim != 2 or u.shape != w.shape:
        raise ValueError(
            f"markov_params u {tuple(u.shape)} and w {tuple(w.shape)} must both be [V, r]"
        )
    if keys == CONTEXT_KEYS:
        t, h, o = (markov_params[n] for n in ("t", "h", "o"))
        v, r = u.shape
        if (
            t.ndim != 2
            or h.ndim != 2
            or t.shape[0] != v
            or h.shape[1] != t.shape[1]
            or (o.shape != (t.shape[1], r))
        ):
            raise ValueError(
                f"contextual markov_params t {tuple(t.shape)}, h {tuple(h.shape)}, o "
                f"{tuple(o.shape)} must be [V, H], [D, H], [H, r] with V={v}, r={r}"
            )
    return u.shape[0], u.shape[1]


def _check_hidden(markov_params: MarkovParams, hidden, lead: tuple) -> None:
    """The contextual head needs hidden [*lead, D]; the plain one takes none."""
    if not is_contextual(markov_params):
        if hidden is not None:
            raise ValueError("hidden given, but markov_params are the plain head's (no t, h, o)")
        return
    d = markov_params["h"].shape[0]
    if hidden is None or tuple(hidden.shape) != (*lead, d):
        got = None if hidden is None else tuple(hidden.shape)
        raise ValueError(f"the contextual Markov head needs hidden {(*lead, d)}; got {got}")


def markov_bias(
    markov_params: MarkovParams, prev_tokens: jax.Array, hidden: jax.Array | None = None
) -> jax.Array:
    """Transition bias `bias(v) = u_k . w(v)`: int [...] (and hidden [..., D] for the
    contextual head) -> float32 [..., V], u_k as in the module docstring.

    Everything runs in float32 at HIGHEST precision so that the q the drafter samples from
    and the q recomputed for verification or training agree to float32 rounding whatever
    the leading shape (no TF32 / bf16 passes on accelerators).
    """
    vocab, _ = _check_markov_params(markov_params)
    check_token_range("prev_tokens", prev_tokens, vocab)
    _check_hidden(markov_params, hidden, tuple(prev_tokens.shape))
    f32 = {n: x.astype(jnp.float32) for n, x in markov_params.items()}
    hi = jax.lax.Precision.HIGHEST
    u_prev = jnp.take(f32["u"], prev_tokens, axis=0)
    if hidden is not None:
        z = jnp.einsum("...d,dh->...h", hidden.astype(jnp.float32), f32["h"], precision=hi)
        z = jax.nn.gelu(z + jnp.take(f32["t"], prev_tokens, axis=0))
        u_prev = u_prev + jnp.einsum("...h,hr->...r", z, f32["o"], precision=hi)
    return jnp.einsum("...r,vr->...v", u_prev, f32["w"], precision=hi)


def teacher_forced_logits(
    base_logits_BxNxKxV: jax.Array,
    markov_params: MarkovParams | None,
    anchors_BxN: jax.Array,
    next_tokens_BxNxK: jax.Array,
    hidden_BxNxKxD: jax.Array | None = None,
) -> jax.Array:
    """Drafter logits with the Markov term on given previous tokens, float32 [B, N, K, V].

    `logits[..., k, :] = base[..., k, :] + u_k . w` (u_k = u(x_{k-1}), plus the context term
    of `hidden[..., k, :]` for the contextual head) with x_0 = the anchor and
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
        if hidden_BxNxKxD is not None:
            raise ValueError("hidden given without markov_params")
        return base
    vocab, _ = _check_markov_params(markov_params)
    if vocab != v:
        raise ValueError(f"markov_params vocab {vocab} != base_logits vocab {v}")
    check_token_range("anchors", anchors_BxN, v)
    check_token_range("next_tokens", next_tokens_BxNxK, v)
    prev_BxNxK = jnp.concatenate(
        [anchors_BxN[..., None], next_tokens_BxNxK[..., :-1]], axis=-1
    ).astype(jnp.int32)
    return base + markov_bias(markov_params, prev_BxNxK, hidden_BxNxKxD)


def markov_draft(
    key: jax.Array,
    base_logits_BxKxV: jax.Array,
    anchors_B: jax.Array,
    markov_params: MarkovParams | None,
    probs_fn: ProbsFn,
    hidden_BxKxD: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sample K drafts sequentially through the Markov head: (drafts int32 [B, K],
    q float32 [B, K, V]).

    For k = 1..K: `q_k = probs_fn(base_k + u_k . w)` (u_k = u(x_{k-1}), plus the context
    term of hidden[:, k] for the contextual head), i.e.
    q_k(v) ∝ exp(base_k(v) + u(x_{k-1}) · w(v)) before the sampling transform, and
    x_k ~ q_k with an independent key per step (x_0 = the anchor). `probs_fn` maps float32
    logits [B, V] to probabilities [B, V] (e.g. `v41jax.decode.sampling.probs_fn(sampling)`;
    temperature 0 gives the greedy argmax chain). The returned q is
    exactly the distribution each draft was drawn from (the verifier's q); a draft never has
    q = 0 (`sample_probs` never draws a zero-probability token). The transformer is not
    re-run: only this O(r V) head is sequential.
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

        _check_hidden(markov_params, hidden_BxKxD, (b, k))
    elif hidden_BxKxD is not None:
        raise ValueError("hidden given without markov_params")

    def step(prev_B, inputs):
        key_k, base_BxV, hidden_BxD = inputs
        logits_BxV = base_BxV
        if markov_params is not None:
            logits_BxV = logits_BxV + markov_bias(markov_params, prev_B, hidden_BxD)
        q_BxV = probs_fn(logits_BxV).astype(jnp.float32)
        x_B = sample_probs(key_k, q_BxV)
        return x_B, (x_B, q_BxV)

    keys_K = jax.random.split(key, k)
    hidden_KxBxD = None if hidden_BxKxD is None else jnp.swapaxes(hidden_BxKxD, 0, 1)
    _, (drafts_KxB, q_KxBxV) = jax.lax.scan(
        step, anchors_B.astype(jnp.int32), (keys_K, jnp.swapaxes(base, 0, 1), hidden_KxBxD)
    )
    return drafts_KxB.T, jnp.swapaxes(q_KxBxV, 0, 1)
