"""The exact speculative sampler on your own distributions, and the audit on your own verifier.

`speculative_sample(key, draft_tokens, draft_probs, target_probs)` verifies K drafted tokens
per row against the target model's distributions (accept draft x with probability
min(1, p(x)/q(x)), else resample from max(0, p - q)) and emits tokens distributed exactly as
the target's. It takes plain arrays, so any drafter and any target work: here both are fixed
random categorical distributions over a small vocabulary, and the draft token is sampled
from the draft distribution by the user's own code.

`audit_verifier(fn)` tests any verifier with the same signature
`fn(key, draft_tokens, draft_probs | None, target_probs, verify_len) -> (tokens, accepted)`
statistically (G-tests of the emitted tokens' laws and of the acceptance counts on fixed
tables). Two verifiers are audited: the exact rule (`speculative_sample` itself) passes; a
wrong one that always accepts every draft is flagged, since its tokens follow the draft
distribution instead of the target's.

Run: python examples/speculative_own_sampler.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v41jax import audit_verifier, speculative_sample

VOCAB = 8
K = 2  # drafts per round


def exact_verifier(key, draft_tokens, draft_probs, target_probs, verify_len):
    """The user's verifier: v41jax's exact rule."""
    return speculative_sample(key, draft_tokens, draft_probs, target_probs, verify_len)


def always_accept_verifier(key, draft_tokens, draft_probs, target_probs, verify_len):
    """A wrong verifier: accepts all verify_len drafts, then a bonus token from p_L."""
    del draft_probs
    b, k = draft_tokens.shape
    length = verify_len.astype(jnp.int32)
    p_last = jnp.take_along_axis(target_probs, length[:, None, None], axis=1)[:, 0]
    bonus = jax.random.categorical(key, jnp.log(p_last), axis=-1).astype(jnp.int32)
    drafts = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.zeros((b, 1), jnp.int32)], 1)
    pos = jnp.arange(k + 1)[None, :]
    out = jnp.where(
        pos < length[:, None], drafts, jnp.where(pos == length[:, None], bonus[:, None], -1)
    )
    return out, length


def own_distributions(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(target p [K+1, V], draft q [K, V]): fixed random categorical laws, float32."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(VOCAB), size=K + 1) * 0.9 + 0.1 / VOCAB
    q = rng.dirichlet(np.ones(VOCAB), size=K) * 0.9 + 0.1 / VOCAB
    return (p / p.sum(-1, keepdims=True)).astype(np.float32), (q / q.sum(-1, keepdims=True)).astype(
        np.float32
    )


def sample_first_tokens(verifier, p, q, num_rows: int, seed: int) -> np.ndarray:
    """Draft K tokens per row from q (the user's own sampler), verify, return token 0 [N]."""
    k_draft, k_verify = jax.random.split(jax.random.key(seed))
    q_rows = jnp.broadcast_to(jnp.asarray(q), (num_rows, K, VOCAB))
    p_rows = jnp.broadcast_to(jnp.asarray(p), (num_rows, K + 1, VOCAB))
    drafts = jax.random.categorical(k_draft, jnp.log(q_rows), axis=-1).astype(jnp.int32)
    verify_len = jnp.full((num_rows,), K, jnp.int32)
    tokens, accepted = jax.jit(verifier)(k_verify, drafts, q_rows, p_rows, verify_len)
    assert np.all(np.asarray(accepted) <= K)
    return np.asarray(tokens[:, 0])


def main(num_rows: int = 20_000, audit_samples: int = 20_000, seed: int = 0) -> dict:
    """Returns the laws p, q; first-token counts of both verifiers; both audit reports."""
    p, q = own_distributions(seed)
    counts = {
        name: np.bincount(sample_first_tokens(fn, p, q, num_rows, seed + 1), minlength=VOCAB)
        for name, fn in [("exact", exact_verifier), ("always_accept", always_accept_verifier)]
    }
    audits = {
        name: audit_verifier(fn, vocab_size=6, k=3, num_samples=audit_samples, seed=seed)
        for name, fn in [("exact", exact_verifier), ("always_accept", always_accept_verifier)]
    }
    return dict(target=p, draft=q, counts=counts, audits=audits)


if __name__ == "__main__":
    r = main()
    print("target p_0:", np.round(r["target"][0], 3))
    print("draft  q_0:", np.round(r["draft"][0], 3))
    for name, c in r["counts"].items():
        print(f"{name:>13} first tokens:", np.round(c / c.sum(), 3))
    for name, report in r["audits"].items():
        print(f"\naudit of {name}:\n{report.summary()}")
