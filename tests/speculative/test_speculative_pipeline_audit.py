"""The pipeline audit (v41jax/speculative/pipeline_audit.py) on toy DSpark-like pipelines.

The toy drafter: per-row random base logits and anchors drawn from the key (independent of the
target), a rank-2 Markov head (`markov_draft`), and per-row random confidences drawn before
drafting. Verify lengths come from the DSpark scheduler over batches of 8 rows on a staircase
cost curve, so they depend on draft-side information only: the audit must pass. The negative
control chooses the length from the target's probabilities of the sampled drafts (verify while
p_j(d_j) >= q_j(d_j)): the rows that reach a long L are those whose drafts the target likes,
so given L the emitted tokens are biased towards them, and the audit must fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.dspark.decode.scheduler import CostTable, schedule_verify_lengths
from v41jax.dspark.model.markov import markov_draft
from v41jax.speculative import speculative_sample
from v41jax.speculative.pipeline_audit import audit_pipeline, make_pipeline_cases

K, V, B = 3, 6, 8  # drafts per row, vocabulary, scheduler batch (rows per decode step)
SAMPLES, CHUNK = 40_000, 20_000  # CHUNK is a multiple of B
_TOKENS = tuple(range(8, 129, 8))
STAIRS = CostTable(_TOKENS, tuple(1.0 + 0.25 * ((t - 1) // 16) for t in _TOKENS))
_KM = jax.random.PRNGKey(7)
MARKOV = {  # rank-2 transition term u(x_{k-1}) . w(v), fixed (the drafter's weights)
    "u": jax.random.normal(_KM, (V, 2)),
    "w": jax.random.normal(jax.random.fold_in(_KM, 1), (V, 2)),
}


def _draft(key, n):
    """Toy DSpark drafter: (confidences [N, K], drafts int32 [N, K], q [N, K, V])."""
    k_conf, k_base, k_anchor, k_draft = jax.random.split(key, 4)
    conf = jax.random.uniform(k_conf, (n, K), minval=0.1, maxval=1.0)  # before the drafts
    base = 1.5 * jax.random.normal(k_base, (n, K, V))
    anchors = jax.random.randint(k_anchor, (n,), 0, V)
    drafts, q = markov_draft(k_draft, base, anchors, MARKOV, jax.nn.softmax)
    return conf, drafts, q


def _scheduled(conf_NxK):
    """Verify lengths per decode step of B rows, from the confidences alone."""
    n = conf_NxK.shape[0]
    sched = jax.vmap(lambda c: schedule_verify_lengths(c, STAIRS, basis="total").verify_len)
    return sched(conf_NxK.reshape(n // B, B, K)).reshape(n)


def dspark_pipeline(key, target_probs):
    k_draft, k_verify = jax.random.split(key)
    conf, drafts, q = _draft(k_draft, target_probs.shape[0])
    lens = _scheduled(conf)
    out, acc = speculative_sample(k_verify, drafts, q, target_probs, lens)
    return drafts, out, acc, lens


def target_peeking_pipeline(key, target_probs):
    """BROKEN: L = number of leading drafts with p_j(d_j) >= q_j(d_j), at least 1."""
    k_draft, k_verify = jax.random.split(key)
    _, drafts, q = _draft(k_draft, target_probs.shape[0])
    p_d = jnp.take_along_axis(target_probs[:, :K], drafts[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    lens = jnp.sum(jnp.cumprod(p_d >= q_d, axis=1), axis=1)
    lens = jnp.maximum(lens, 1).astype(jnp.int32)
    out, acc = speculative_sample(k_verify, drafts, q, target_probs, lens)
    return drafts, out, acc, lens


def random_length_pipeline(key, target_probs):
    """The plain exact verifier with L uniform in [0, K], drawn independently of everything."""
    k_draft, k_len, k_verify = jax.random.split(key, 3)
    _, drafts, q = _draft(k_draft, target_probs.shape[0])
    lens = jax.random.randint(k_len, (target_probs.shape[0],), 0, K + 1)
    out, acc = speculative_sample(k_verify, drafts, q, target_probs, lens)
    return drafts, out, acc, lens


def _audit(pipeline):
    return audit_pipeline(pipeline, vocab_size=V, k=K, num_samples=SAMPLES, chunk=CHUNK)


def test_scheduled_dspark_pipeline_is_lossless():
    report = _audit(dspark_pipeline)
    assert report.passed, report.format()
    names = {(t.case, t.name) for t in report.tests}
    for case in ("random", "target_zero", "peaked"):
        assert {(case, "validity"), (case, "verify_len"), (case, "law 1|L,h")} <= names
    # the scheduler really varies the length (else this would be the fixed-length audit)
    _, _, _, lens = jax.jit(dspark_pipeline)(
        jax.random.PRNGKey(1), jnp.full((800, K + 1, V), 1 / V)
    )
    assert len(np.unique(np.asarray(lens))) >= 2


def test_length_from_target_information_fails_the_audit():
    report = _audit(target_peeking_pipeline)
    assert not report.passed
    assert report.log10_p_value < -5, report.format()
    assert any("|L,h" in t.name for t in report.failed)


def test_plain_verifier_with_independent_lengths_passes():
    report = _audit(random_length_pipeline)
    assert report.passed, report.format()


def _malformed(key, target_probs):
    drafts, out, acc, lens = random_length_pipeline(key, target_probs)
    return drafts, out, acc, lens + K  # L > K: an invalid verify length


def _ok_shapes(p):
    n = p.shape[0]
    return (
        jnp.zeros((n, K), jnp.int32),
        jnp.zeros((n, K + 1), jnp.int32),
        jnp.zeros(n),
        jnp.zeros(n),
    )


def test_out_of_range_lengths_and_bad_shapes_are_caught():
    report = audit_pipeline(_malformed, vocab_size=V, k=K, num_samples=2_000)
    assert not report.passed
    assert {t.name for t in report.failed} >= {"verify_len"}
    transposed = lambda key, p: (jnp.zeros((K, p.shape[0]), jnp.int32),) + _ok_shapes(p)[1:]
    with pytest.raises(ValueError, match="shapes"):
        audit_pipeline(transposed, vocab_size=V, k=K, num_samples=100, jit=False)
    with pytest.raises(ValueError, match="vocab_size >= 3"):
        audit_pipeline(dspark_pipeline, vocab_size=2)


def test_cases_are_valid_target_tables():
    for case in make_pipeline_cases(V, K, seed=0):
        assert case.p.shape == (K + 1, V) and case.p.dtype == np.float32
        np.testing.assert_allclose(case.p.sum(-1), 1.0, rtol=1e-6)
        assert (case.p >= 0).all()
    zero = {c.name: c for c in make_pipeline_cases(V, K, seed=0)}["target_zero"]
    assert ((zero.p == 0).sum(-1) == 1).all()
