"""Speculative verification: both Pallas kernels equal the reference exactly.

"blocked" is the TPU kernel (reached through ``spec_verify(impl="pallas")`` on CPU),
"rowloop" the GPU/Triton one. Vocabulary sizes are not block multiples (V=1000 / 256,
V=129 / 128) or smaller than a block (V=37); B is odd. Targets are mixtures of the draft
law and noise so that runs of acceptances, rejections and bonus tokens all occur. Kernel
tests take the ``interpret`` fixture (tests/conftest.py): both kernels interpreted here;
the compiled twin (``-k compiled``, on a GPU/TPU) runs the kernel of that platform.
Lowering for TPU/GPU at B=128, K=7, V=129,280: test_lowering_spec_verify.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.spec_verify import IMPLS, spec_verify, spec_verify_reference
from v41jax.kernels.spec_verify.kernel import spec_verify_blocked, spec_verify_rowloop

ON_CPU = jax.default_backend() == "cpu"
# Jitted: one compile per shape instead of one per op (the suite is compile bound on CPU).
reference = jax.jit(spec_verify_reference)


def _inputs(b, k, v, seed, dtype=jnp.float32, with_q=True):
    """(draft_tokens, draft_probs | None, target_probs, verify_len, accept_u, race_u)."""
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(v, 0.3), (b, k))
    draws = rng.uniform(size=(b, k, 1))
    d = np.minimum((np.cumsum(q, -1) < draws).sum(-1), v - 1).astype(np.int32)
    if not with_q:  # one-hot drafts: the target mixes in that one-hot instead
        q = np.eye(v)[d]
    noise = rng.dirichlet(np.full(v, 0.3), (b, k + 1))
    mix = rng.uniform(0.0, 1.0, (b, 1, 1))  # p(d)/q(d) >= mix: per-row acceptance level
    p = noise.copy()
    p[:, :k] = mix * q + (1 - mix) * noise[:, :k]
    verify_len = rng.integers(0, k + 1, b).astype(np.int32)
    verify_len[0], verify_len[-1] = 0, k
    accept_u = rng.uniform(size=(b, k))
    race_u = rng.uniform(size=(b, v))
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
    qq = cast(q) if with_q else None
    return jnp.asarray(d), qq, cast(p), jnp.asarray(verify_len), cast(accept_u), cast(race_u)


def _pow2(n):
    return 1 << (n - 1).bit_length()


def _kernels(interpret):
    """The kernels a test runs: both interpreted, or the compiled one of this platform."""
    if interpret:
        return [spec_verify_blocked, spec_verify_rowloop]
    return [spec_verify_rowloop if jax.default_backend() == "gpu" else spec_verify_blocked]


def _check_all(args, block_v, vocab=None, interpret=True):
    """The kernels == reference exactly; returns the reference (tokens, counts)."""
    v = args[2].shape[-1] if vocab is None else vocab
    ref_args = args if vocab is None else _slice_vocab(args, vocab)
    want = reference(*ref_args)
    for fn in _kernels(interpret):
        bv = _pow2(block_v) if fn is spec_verify_rowloop else block_v
        got = fn(*args, vocab_size=v, block_v=bv, interpret=interpret)
        assert got[0].dtype == jnp.int32 and got[1].dtype == jnp.int32
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    return want


def _slice_vocab(args, v):
    d, q, p, verify_len, accept_u, race_u = args
    return d, None if q is None else q[..., :v], p[..., :v], verify_len, accept_u, race_u[:, :v]


# (B, K, V, block_v, with_q, dtype)
CASES = [
    (7, 3, 1000, 256, True, jnp.float32),
    (7, 3, 1000, 256, False, jnp.float32),
    (3, 1, 37, 256, True, jnp.float32),
    (3, 5, 129, 128, True, jnp.bfloat16),
    (7, 5, 129, 128, False, jnp.bfloat16),
]
# The special cases below reuse CASES[0]'s shapes, so they hit the compile cache.
B, K, V, BLOCK_V = CASES[0][:4]
# Fast: V over several blocks with drafts, V under one block, bf16 with one-hot drafts; the
# other two (one-hot drafts in f32, bf16 with drafts) are slow in the interpreter.
SLOW_CASES = (1, 3)


@pytest.mark.parametrize(
    "b,k,v,block_v,with_q,dtype",
    [
        pytest.param(*c, marks=pytest.mark.slow if i in SLOW_CASES else ())
        for i, c in enumerate(CASES)
    ],
)
def test_kernels_match_reference_exactly(interpret, b, k, v, block_v, with_q, dtype):
    # Compiled, the kernel's log1p/divide may differ from XLA's by an ulp, which could flip
    # an exact-key near-tie; with continuous random keys that has negligible probability.
    seen = set()
    for seed in range(3):
        args = _inputs(b, k, v, seed, dtype, with_q)
        out, num = spec_verify(*args, impl="pallas", block_v=block_v, interpret=interpret)
        want = _check_all(args, block_v, interpret=interpret)
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(num, want[1])
        assert int(jnp.max(out)) < v
        pairs = zip(num.tolist(), np.asarray(args[3]).tolist(), strict=True)
        seen |= {("bonus" if a == n else "reject", a) for a, n in pairs}
    # The data exercise both outcomes, including rejections after accepted drafts.
    kinds = {kind for kind, _ in seen}
    assert kinds == {"bonus", "reject"}, seen
    if k > 1:
        assert any(kind == "reject" and a > 0 for kind, a in seen), seen


def test_zero_target_on_drafts_forces_rejection(interpret):
    args = list(_inputs(B, K, V, seed=7))
    d, q, p = args[0], args[1], args[2]
    p = p.at[jnp.arange(B)[:, None], jnp.arange(K)[None, :], d].set(0.0)  # p_j(d_j) = 0
    args[2] = p
    args[3] = jnp.full((B,), K, jnp.int32)
    for drafts in (q, None):
        args[1] = drafts
        out, num = _check_all(tuple(args), BLOCK_V, interpret=interpret)
        np.testing.assert_array_equal(num, 0)
        assert bool(jnp.all(out[:, 0] != d[:, 0]))  # the residual excludes d_0
        np.testing.assert_array_equal(out[:, 1:], -1)


def test_residual_without_mass_falls_back_to_target(interpret):
    """q_0 = p_0 with q_0(d_0) = 0: d_0 is rejected (0 < 0 fails) and max(0, p_0 - q_0) = 0,
    so the token is the p_0 race winner."""
    d, q, p, _, accept_u, race_u = _inputs(B, K, V, seed=11)
    p = p.at[jnp.arange(B), 0, d[:, 0]].set(0.0)
    q = q.at[:, 0, :].set(p[:, 0, :])
    verify_len = jnp.full((B,), K, jnp.int32)
    out, num = _check_all((d, q, p, verify_len, accept_u, race_u), BLOCK_V, interpret=interpret)
    np.testing.assert_array_equal(num, 0)
    e = -jnp.log1p(-race_u)
    keys = jnp.where(p[:, 0] > 0, e / jnp.where(p[:, 0] > 0, p[:, 0], 1.0), jnp.inf)
    np.testing.assert_array_equal(out[:, 0], jnp.argmin(keys, axis=-1))


def test_ties_keep_the_first_index_across_blocks(interpret):
    """Equal keys in columns 300, 301 and 700 (blocks 1 and 2 of 256): argmin picks 300,
    for the bonus race (L = 0) and for the residual race (d_0 = 0 rejected, p_0(0) = 0)."""
    assert BLOCK_V == 256
    d = jnp.zeros((B, K), jnp.int32)
    p = jnp.zeros((B, K + 1, V)).at[:, :, jnp.array([300, 301, 700])].set(0.25)
    race_u = jnp.full((B, V), 0.5, jnp.float32)
    verify_len = jnp.arange(B, dtype=jnp.int32) % 2
    args = (d, None, p, verify_len, jnp.zeros((B, K)), race_u)
    out, num = _check_all(args, BLOCK_V, interpret=interpret)
    np.testing.assert_array_equal(out[:, 0], 300)
    np.testing.assert_array_equal(num, 0)


def test_columns_past_vocab_are_never_emitted(interpret):
    """Arrays wider than vocab_size whose extra columns would win every race (large p, q = 0,
    race_u = 0 so E = 0) must still give ids < V and the reference on the first V columns;
    also a row whose real p is all zero (every key +inf: the reference's argmin is 0)."""
    b, k, v, pad = 3, 2, 129, 127
    d, q, p, verify_len, accept_u, race_u = _inputs(b, k, v, seed=5)
    p = p.at[2].set(0.0)
    widen = lambda a, val: jnp.concatenate([a, jnp.full((*a.shape[:-1], pad), val, a.dtype)], -1)
    race_u = jnp.maximum(race_u, 0.5)  # real columns: E >= log 2, padding: E = 0
    args = (d, widen(q, 0.0), widen(p, 1.0), verify_len, accept_u, widen(race_u, 0.0))
    for drafts in (args[1], None):
        out, num = _check_all((d, drafts, *args[2:]), block_v=128, vocab=v, interpret=interpret)
        assert int(jnp.max(out)) < v
        assert int(num[2]) == 0 and int(out[2, 0]) == 0  # p(d) = 0 rejects; all keys +inf
    # Through the API, the ragged last block (V = 129 = 128 + 1) of unspecified padding.
    out, _ = spec_verify(*_slice_vocab(args, v), impl="pallas", block_v=128, interpret=interpret)
    assert int(jnp.max(out)) < v


def test_no_drafts_k0_and_empty_batch(interpret):
    d, q, p, _, _, race_u = _inputs(3, 0, 37, seed=3)
    args = (d, q, p, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 0)), race_u)
    out, num = spec_verify(*args, impl="pallas", interpret=interpret)
    want = reference(*args)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(num, want[1])
    args = _inputs(1, 2, 37, seed=3)
    empty = tuple(None if a is None else a[:0] for a in args)
    out, num = spec_verify(*empty, impl="pallas", interpret=interpret)
    assert out.shape == (0, 3) and num.shape == (0,)


def test_dispatch_and_jit():
    assert IMPLS == ("auto", "pallas", "reference")
    args = _inputs(B, K, V, seed=2)
    want = reference(*args)
    for impl in IMPLS:
        out, num = spec_verify(*args, impl=impl, block_v=BLOCK_V)
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(num, want[1])
    jitted = jax.jit(lambda *a: spec_verify(*a, impl="pallas", block_v=BLOCK_V))
    np.testing.assert_array_equal(jitted(*args)[0], want[0])
    with pytest.raises(ValueError, match="impl"):
        spec_verify(*args, impl="xla")
    with pytest.raises(ValueError, match="block_v"):
        spec_verify(*args, impl="pallas", block_v=0)
    if ON_CPU:  # compiled Pallas run (lowered) for CPU
        with pytest.raises(ValueError, match="interpret=True"):
            spec_verify(*args, impl="pallas", interpret=False)
        with pytest.raises(ValueError, match="interpret=True"):
            jax.jit(lambda *a: spec_verify(*a, impl="pallas", interpret=False))(*args)


def _bad(name, value):
    names = ["d", "q", "p", "verify_len", "accept_u", "race_u"]
    args = dict(zip(names, _inputs(3, 2, 37, 0), strict=True))
    args[name] = value
    return args


BAD = [
    ("draft_tokens", "d", jnp.zeros((3, 2), jnp.float32)),
    ("draft_tokens", "d", jnp.zeros((3,), jnp.int32)),
    ("draft_probs", "q", jnp.zeros((3, 2, 36))),
    ("draft_probs", "q", jnp.zeros((3, 2, 37), jnp.int32)),
    ("target_probs", "p", jnp.zeros((3, 2, 37))),
    ("target_probs", "p", jnp.zeros((3, 3, 37), jnp.int32)),
    ("verify_len", "verify_len", jnp.zeros((3, 1), jnp.int32)),
    ("verify_len", "verify_len", jnp.zeros((3,), jnp.float32)),
    ("accept_u", "accept_u", jnp.zeros((3, 3))),
    ("accept_u", "accept_u", jnp.zeros((3, 2), jnp.int32)),
    ("race_u", "race_u", jnp.zeros((3, 36))),
    ("race_u", "race_u", jnp.zeros((3, 37), jnp.bool_)),
]


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("label,name,value", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_validation_names_the_value(impl, label, name, value):
    with pytest.raises(ValueError, match=label):
        spec_verify(*_bad(name, value).values(), impl=impl)
