"""Sampling: greedy limits of top-k / top-p / temperature, truncation sets, distribution test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.decode import SamplingParams, sample_logits, sampling_probs

LOGITS = jax.random.normal(jax.random.key(0), (16, 50)) * 3
sample = jax.jit(sample_logits)


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6), (5.0, 1, 0.5), (0.0, 7, 0.3)],
)
def test_greedy_limits_equal_argmax(temperature, top_k, top_p):
    greedy = np.argmax(LOGITS, -1)
    for seed in range(3):
        toks = sample(jax.random.key(seed), LOGITS, SamplingParams(temperature, top_k, top_p))
        assert toks.dtype == jnp.int32
        np.testing.assert_array_equal(toks, greedy)


def np_truncated_probs(z, temperature, top_k, top_p):
    """Reference: sort, keep top_k, keep the smallest prefix with mass >= top_p."""
    z = z / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    kept_k = order[:top_k] if top_k else order
    p = np_softmax(z[kept_k])
    n = int(np.searchsorted(np.cumsum(p), top_p) + 1) if top_p < 1 else len(kept_k)
    keep[kept_k[:n]] = True
    return np.where(keep, np_softmax(np.where(keep, z, -np.inf)), 0.0)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (10, 0.5), (0, 1.0)])
def test_sampling_probs_truncation(top_k, top_p):
    probs = np.asarray(sampling_probs(LOGITS, SamplingParams(0.7, top_k, top_p)))
    want = np.stack([np_truncated_probs(np.asarray(z), 0.7, top_k, top_p) for z in LOGITS])
    np.testing.assert_allclose(probs, want, atol=1e-6)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    if top_k and top_p == 1.0:
        assert np.all((probs > 0).sum(-1) == top_k)


def chi_square(samples, probs):
    counts = np.bincount(np.asarray(samples), minlength=len(probs))
    expected = len(samples) * probs
    nz = expected > 0
    assert np.all(counts[~nz] == 0), "sampled a token of probability 0"
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum()), int(nz.sum()) - 1


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.9)])
def test_sample_distribution_matches_probs(top_k, top_p):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.5], np.float32)
    n, temperature = 20_000, 0.8
    sampling = SamplingParams(temperature, top_k, top_p)
    toks = sample(jax.random.key(42), jnp.broadcast_to(logits, (n, 5)), sampling)
    want = np_truncated_probs(logits, temperature, top_k, top_p)
    stat, dof = chi_square(toks, want)
    critical = {4: 18.47, 3: 16.27, 2: 13.82}[dof]  # chi-square, p = 0.001
    assert stat < critical, (stat, dof)


def test_per_row_and_traced_knobs():
    temperature = jnp.array([0.0] * 8 + [1.0] * 8)
    toks = jax.jit(sample_logits)(jax.random.key(3), LOGITS, SamplingParams(temperature, 0, 1.0))
    np.testing.assert_array_equal(toks[:8], np.argmax(LOGITS[:8], -1))
    probs = sampling_probs(LOGITS, SamplingParams(1.0, jnp.array([1] * 8 + [0] * 8), 1.0))
    assert np.all((np.asarray(probs[:8]) > 0).sum(-1) == 1)
    assert np.all((np.asarray(probs[8:]) > 0).sum(-1) == 50)


def test_per_row_knobs_go_along_the_leading_axis_of_3d_logits():
    """Per-row settings [B] against logits [B, T, V] (a speculative verify's K + 1 positions),
    with B == T so that trailing-axis broadcasting would silently mix rows up: every position
    of row b uses row b's settings, as row b alone does."""
    b = 4
    logits = jax.random.normal(jax.random.key(5), (b, b, 50))
    knobs = SamplingParams(
        jnp.array([0.0, 0.5, 1.0, 2.0]), jnp.array([0, 3, 0, 7]), jnp.array([1.0, 1.0, 0.6, 0.9]),
        jnp.array([0.0, 0.1, 0.0, 0.0]),
    )  # fmt: skip
    got = sampling_probs(logits, knobs)
    for r in range(b):
        t, k, p, m = (knobs.temperature[r], knobs.top_k[r], knobs.top_p[r], knobs.min_p[r])
        row = SamplingParams(float(t), int(k), float(p), float(m))
        np.testing.assert_allclose(got[r], sampling_probs(logits[r], row), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": "4"}, "top_k='4' must be a number"),
    ],
)
def test_bad_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sample_probs_law_zeros_and_shapes():
    """Inverse-CDF draws: G-test against the law on 40k rows (zeros at both ends and inside,
    a near-1 mass and tiny ones), zero-probability tokens never drawn; a negative control
    (the law with two masses swapped) must be rejected; leading shapes are kept."""
    from scipy import stats

    from v41jax.decode.sampling import sample_probs

    law = np.array([0.0, 0.5, 0.0, 0.2, 1e-3, 0.299, 0.0], np.float64)
    n = 40_000
    toks = np.asarray(
        jax.jit(sample_probs)(jax.random.key(7), jnp.broadcast_to(law.astype(np.float32), (n, 7)))
    )
    assert toks.dtype == np.int32 and toks.shape == (n,)
    counts = np.bincount(toks, minlength=7)
    assert counts[law == 0].sum() == 0
    pos = law > 0
    assert stats.power_divergence(counts[pos], law[pos] * n, lambda_="log-likelihood").pvalue > 1e-3
    wrong = law[pos][[0, 3, 2, 1]]  # 0.2 and 0.299 swapped
    assert stats.power_divergence(counts[pos], wrong * n, lambda_="log-likelihood").pvalue < 1e-6
    one_hot = jnp.zeros((2, 3, 5)).at[..., 4].set(1.0)  # the last token, leading shape [2, 3]
    np.testing.assert_array_equal(sample_probs(jax.random.key(0), one_hot), np.full((2, 3), 4))


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The law as one plain computation with every stage traced in and no branch: what
    `sampling_probs` must equal bit for bit whichever stages its plan skips."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    row = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), logits.shape[:-1])[..., None]
    t, k = row(temperature, jnp.float32), row(top_k, jnp.int32)
    p, m = row(top_p, jnp.float32), row(min_p, jnp.float32)
    z = logits / jnp.where(t <= 0, 1.0, t)
    order = jnp.argsort(-z, axis=-1, stable=True)
    keep_sorted = (k <= 0) | (jnp.arange(v) < k)
    z_sorted = jnp.take_along_axis(z, order, axis=-1)
    p_sorted = jax.nn.softmax(jnp.where(keep_sorted, z_sorted, -jnp.inf), axis=-1)
    keep_sorted &= (jnp.cumsum(p_sorted, axis=-1) - p_sorted < p) | (p >= 1.0)
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    keep &= (m <= 0) | (z >= jnp.max(z, -1, keepdims=True) + jnp.log(jnp.maximum(m, 1e-30)))
    probs = jax.nn.softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(t <= 0, one_hot, probs)


KNOBS = [  # (temperature, top_k, top_p, min_p): every stage off and on, alone and together
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (0.7, 0, 0.8, 0.0),
    (1.3, 0, 1.0, 0.1),
    (1.3, 10, 0.9, 0.05),
    (0.0, 3, 0.5, 0.2),
    (np.array([0.0, 1.0, 0.5, 2.0] * 4), 0, 1.0, 0.0),  # per row, some rows greedy
    (1.0, np.array([0, 1, 3, 100] * 4), np.array([1.0, 0.5] * 8), 0.0),
]


@pytest.mark.parametrize("v", [1, 7, 4097])
@pytest.mark.parametrize("knobs", KNOBS, ids=range(len(KNOBS)))
def test_plans_give_the_reference_law_and_tokens(v, knobs):
    """Python knobs (a plan that skips the stages they turn off), traced knobs (every stage,
    the sort behind a runtime branch) and the plain reference: the same probabilities bit for
    bit, and the same token for the same key at every odd vocabulary size."""
    from v41jax.decode.sampling import GENERAL_PLAN, sample_probs, sampling_plan

    logits = jax.random.normal(jax.random.key(v), (16, v)) * 4
    logits = logits.at[:, v // 2].set(logits[:, 0])  # a tie, ordered by token id
    want = np.asarray(jax.jit(reference_probs)(logits, *knobs))
    sampling = SamplingParams(*knobs)
    static = jax.jit(lambda x: sampling_probs(x, sampling))(logits)
    traced = jax.jit(sampling_probs)(logits, sampling)
    general = jax.jit(lambda x, s: sampling_probs(x, s, plan=GENERAL_PLAN))(logits, sampling)
    for got in (static, traced, general):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert sampling_plan(SamplingParams(*map(jnp.asarray, knobs))) == sampling_plan(sampling)
    for seed in range(2):
        key = jax.random.key(seed)
        tok = np.asarray(jax.jit(sample_probs)(key, want))
        np.testing.assert_array_equal(
            jax.jit(lambda x, k: sample_logits(k, x, sampling))(logits, key), tok
        )
        np.testing.assert_array_equal(jax.jit(sample_logits)(key, logits, sampling), tok)


def test_sampling_plan_from_values():
    from v41jax.decode.sampling import GENERAL_PLAN, SamplingPlan, sampling_plan

    S = SamplingParams
    assert sampling_plan(S(0.0, 5, 0.5, 0.1)) == SamplingPlan(True, False, False, False)
    assert sampling_plan(S(1.0)) == SamplingPlan(False, False, False, False)
    assert sampling_plan(S(np.array([0.0, 1.0]), 2, 1.0, 0.0)) == SamplingPlan(
        None, True, False, False
    )
    assert sampling_plan(S(1.0, 0, np.array([1.0, 0.9]), 0.0)) == SamplingPlan(
        False, False, True, False
    )
    traced = jax.jit(lambda t, k, p, m: jnp.asarray(sampling_plan(S(t, k, p, m)) == GENERAL_PLAN))
    assert traced(1.0, 0, 1.0, 0.0)
