"""speculative_sample: exact output law (G-tests at fixed seeds, with negative controls), the
contract (shapes, -1 padding, verify_len, fp32 on bf16 input, ids < V, no-mass fallback),
jit-ability, row independence, and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from v41jax.decode.sampling import SamplingParams, sampling_probs
from v41jax.speculative import speculative_sample
from v41jax.speculative.sampler import sample_inverse_cdf


def g_test(counts, probs):
    """p-value of a G-test of counts against probs (cells with probability 0 must be empty)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    assert counts[probs == 0].sum() == 0, "a token with zero probability was emitted"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.power_divergence(counts[keep], expected, lambda_="log-likelihood").pvalue


def tables(seed, k, v, b):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.7), size=k + 1).astype(np.float32)
    q = rng.dirichlet(np.full(v, 0.7), size=k).astype(np.float32)
    drafts = np.stack([rng.choice(v, size=b, p=q[j] / q[j].sum()) for j in range(k)], axis=1)
    return (
        jnp.asarray(drafts, jnp.int32),
        jnp.broadcast_to(jnp.asarray(q), (b, k, v)),
        jnp.broadcast_to(jnp.asarray(p), (b, k + 1, v)),
        p,
        q,
    )


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_first_token_and_acceptance_follow_the_exact_law(impl):
    k, v, b = 3, 7, 100_000
    d, q_b, p_b, p, q = tables(0, k, v, b)
    out, acc = speculative_sample(jax.random.key(1), d, q_b, p_b, impl=impl)
    out, acc = np.asarray(out), np.asarray(acc)
    assert g_test(np.bincount(out[:, 0], minlength=v), p[0]) > 1e-3
    beta = np.minimum(p[:k], q).sum(axis=1)
    surv = np.concatenate([[1.0], np.cumprod(beta)])  # P(A >= a), a = 0..K
    law = surv - np.append(surv[1:], 0.0)
    assert g_test(np.bincount(acc, minlength=k + 1), law) > 1e-3
    # The token after A accepted drafts follows p_A (given A >= 1, position 1 must be p_1).
    emitted = acc >= 1
    assert g_test(np.bincount(out[emitted, 1], minlength=v), p[1]) > 1e-3


def test_negative_control_residual_from_p_fails():
    """Sampling the rejection token from p instead of max(0, p - q) must be caught."""
    k, v, b = 1, 7, 100_000
    d, q_b, p_b, p, q = tables(2, k, v, b)
    out, acc = speculative_sample(jax.random.key(3), d, q_b, p_b)
    out, acc = np.asarray(out), np.asarray(acc)
    rng = np.random.default_rng(4)
    broken = np.where(acc == 1, out[:, 0], rng.choice(v, size=b, p=p[0] / p[0].sum()))
    assert g_test(np.bincount(out[:, 0], minlength=v), p[0]) > 1e-3
    assert g_test(np.bincount(broken, minlength=v), p[0]) < 1e-6


def test_output_layout_verify_len_and_bf16():
    k, v, b = 4, 11, 4096
    d, q_b, p_b, _, _ = tables(5, k, v, b)
    vl = jnp.asarray(np.random.default_rng(6).integers(0, k + 1, b), jnp.int32)
    out, acc = speculative_sample(
        jax.random.key(7), d, q_b.astype(jnp.bfloat16), p_b.astype(jnp.bfloat16), vl
    )
    out, acc = np.asarray(out), np.asarray(acc)
    assert out.dtype == np.int32 and acc.dtype == np.int32 and out.shape == (b, k + 1)
    assert np.all(acc <= np.asarray(vl)) and np.all(acc >= 0)
    for row in range(b):
        a = acc[row]
        np.testing.assert_array_equal(out[row, :a], np.asarray(d)[row, :a])
        assert 0 <= out[row, a] < v and np.all(out[row, a + 1 :] == -1)
    assert np.any(acc == 0) and np.any(acc == k)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_zero_target_on_draft_and_residual_without_mass_falls_back_to_p(impl):
    """p = q but the drafted token has q(d) = p(d) = 0: always rejected, max(0, p - q) = 0,
    so the token must come from p (never the draft, never id 0 by default)."""
    v, b = 5, 50_000
    p = np.array([0.0, 0.1, 0.2, 0.3, 0.4], np.float32)
    q_b = jnp.broadcast_to(jnp.asarray(p), (b, 1, v))
    p_b = jnp.broadcast_to(jnp.asarray(p), (b, 2, v))
    d = jnp.zeros((b, 1), jnp.int32)
    out, acc = speculative_sample(jax.random.key(8), d, q_b, p_b, impl=impl)
    assert np.all(np.asarray(acc) == 0)
    assert g_test(np.bincount(np.asarray(out)[:, 0], minlength=v), p) > 1e-3


def test_ids_stay_below_vocab_when_mass_sits_in_the_last_column():
    v, b = 1000, 20_000  # not a multiple of the 256-wide inverse-CDF block
    w = np.zeros(v, np.float32)
    w[-1], w[3] = 0.999, 0.001
    tok = np.asarray(
        sample_inverse_cdf(jnp.broadcast_to(jnp.asarray(w), (b, v)), jnp.full((b,), 0.99999994))
    )
    assert np.all(tok == v - 1)
    tok = np.asarray(
        sample_inverse_cdf(
            jnp.broadcast_to(jnp.asarray(w), (b, v)), jax.random.uniform(jax.random.key(0), (b,))
        )
    )
    assert set(np.unique(tok)) <= {3, v - 1}


def test_inverse_cdf_is_exactly_the_float64_inverse_cdf_of_its_uniform():
    """Given u, the two-level search picks the same index as a float64 searchsorted over
    the normalised cumulative weights: the law is exact up to float32 rounding of u."""
    rng = np.random.default_rng(9)
    w = rng.random(600) * (rng.random(600) < 0.05)
    b = 100_000
    u = jax.random.uniform(jax.random.key(10), (b,))
    tok = sample_inverse_cdf(jnp.broadcast_to(jnp.asarray(w, jnp.float32), (b, 600)), u)
    want = np.searchsorted(np.cumsum(w) / w.sum(), np.asarray(u, np.float64), side="right")
    assert np.mean(np.asarray(tok) == want) > 0.9999  # float32 vs float64 boundary ties
    assert np.all(w[np.asarray(tok)] > 0)


def test_greedy_drafts_one_hot_equals_none_and_is_deterministic():
    v, k, b = 9, 3, 64
    logits = jax.random.normal(jax.random.key(11), (b, k + 1, v))
    p = sampling_probs(logits, SamplingParams(0.0))
    d = jnp.argmax(logits[:, :k], axis=-1).astype(jnp.int32)
    d = d.at[::3, 1].set((d[::3, 1] + 1) % v)  # some wrong drafts
    out_none, acc_none = speculative_sample(jax.random.key(12), d, None, p)
    q = jax.nn.one_hot(d, v)
    out_q, acc_q = speculative_sample(jax.random.key(13), d, q, p)
    np.testing.assert_array_equal(out_none, out_q)
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    for row in range(b):
        a = int(acc_none[row])
        np.testing.assert_array_equal(np.asarray(out_none)[row, : a + 1], greedy[row, : a + 1])


def test_jit_without_host_sync_and_rows_independent():
    k, v, b = 2, 13, 32
    d, q_b, p_b, _, _ = tables(14, k, v, b)
    fn = jax.jit(lambda key, d, q, p, vl: speculative_sample(key, d, q, p, vl))
    vl = jnp.full((b,), k, jnp.int32)
    out, acc = fn(jax.random.key(15), d, q_b, p_b, vl)
    # Changing other rows' inputs leaves row 0 unchanged.
    d2 = d.at[1:].set((d[1:] + 1) % v)
    p2 = p_b.at[1:].set(jnp.roll(p_b[1:], 1, axis=-1))
    out2, acc2 = fn(jax.random.key(15), d2, q_b, p2, vl)
    np.testing.assert_array_equal(out[0], out2[0])
    assert int(acc[0]) == int(acc2[0])


def test_reference_and_pallas_impls_agree():
    k, v, b = 3, 300, 9
    d, q_b, p_b, _, _ = tables(16, k, v, b)
    vl = jnp.asarray([0, 1, 2, 3, 3, 2, 1, 0, 3], jnp.int32)
    ref = speculative_sample(jax.random.key(17), d, q_b, p_b, vl, impl="reference")
    pal = speculative_sample(jax.random.key(17), d, q_b, p_b, vl, impl="pallas")
    np.testing.assert_array_equal(ref[0], pal[0])
    np.testing.assert_array_equal(ref[1], pal[1])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(draft_tokens=jnp.zeros((2,), jnp.int32)), "draft_tokens"),
        (dict(draft_tokens=jnp.zeros((2, 2), jnp.float32)), "draft_tokens"),
        (dict(draft_tokens=jnp.full((2, 2), 5, jnp.int32)), r"\[5, 5, 5, 5\] outside"),
        (dict(target_probs=jnp.full((2, 2, 5), 0.2)), "K\\+1=3"),
        (dict(draft_probs=jnp.full((2, 2, 4), 0.25)), "draft_probs"),
        (dict(target_probs=jnp.full((2, 3, 5), 0.3)), "sums to 1.5"),
        (dict(draft_probs=-jnp.full((2, 2, 5), 0.2)), ">= 0"),
        (dict(verify_len=jnp.asarray([3, 0], jnp.int32)), r"\[0, K=2\]"),
        (dict(target_probs=jnp.full((2, 3, 5), 1, jnp.int32)), "floating"),
    ],
)
def test_bad_inputs_are_named(bad, match):
    args = dict(
        draft_tokens=jnp.zeros((2, 2), jnp.int32),
        draft_probs=jnp.full((2, 2, 5), 0.2),
        target_probs=jnp.full((2, 3, 5), 0.2),
        verify_len=jnp.asarray([2, 1], jnp.int32),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        speculative_sample(jax.random.key(0), **args)


# ------------------------------------------------- one sampling function for draft and target

SETTINGS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.3, min_p=0.1),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_equals_plain_sampling_under_each_setting(name):
    """Draft and target distributions come from the same `sampling_probs(logits, setting)`;
    the first emitted token must have the law of plain sampling with that setting (and
    follow it exactly: G-test against the analytic probabilities); a drafter that skips
    the setting (q from plain softmax) must fail."""
    setting = SETTINGS[name]
    v, k, b = 12, 2, 60_000
    key_t, key_d, key_s, key_x = jax.random.split(jax.random.key(20 + len(name)), 4)
    target_logits = 2.0 * jax.random.normal(key_t, (k + 1, v))
    draft_logits = target_logits[:k] + jax.random.normal(key_d, (k, v))
    p = sampling_probs(target_logits, setting)
    q = sampling_probs(draft_logits, setting)
    q_wrong = jax.nn.softmax(draft_logits, axis=-1)  # the setting applied on one side only
    want = np.asarray(p[0], np.float64)
    for q_used, q_passed, should_pass in ((q, q, True), (q_wrong, q, False)):
        drafts = jax.random.categorical(key_s, jnp.log(q_used), axis=-1, shape=(b, k))
        out, _ = speculative_sample(
            key_x,
            drafts.astype(jnp.int32),
            jnp.broadcast_to(q_passed, (b, k, v)),
            jnp.broadcast_to(p, (b, k + 1, v)),
        )
        counts = np.bincount(np.asarray(out)[:, 0], minlength=v)
        if should_pass:
            assert g_test(counts, want) > 1e-3
            plain = jax.random.categorical(key_x, jnp.log(p[0]), shape=(b,))
            plain_counts = np.bincount(np.asarray(plain), minlength=v)
            table = np.stack([counts, plain_counts])[:, want > 0]
            assert stats.chi2_contingency(table).pvalue > 1e-3
        else:
            zero = counts[want == 0].sum()
            assert zero > 0 or g_test(counts, want) < 1e-6
