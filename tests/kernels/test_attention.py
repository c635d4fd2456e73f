"""Attention implementations equal the masked reference in values and in q/k/v gradients.

Layouts: causal self-attention, several packed segments per row, KV-cache queries at
per-row offsets over S slots (slots past a row's position hold garbage), decode (T = 1),
non-index-causal positions (restarting per document), and fully masked padding rows
(queries at position -1 see no key: output 0, zero and finite gradients; the reference
averages uniformly there, so comparisons use only rows that see >= 1 key). T is not a
block multiple; GQA with H = 4 over G = 2 and G = 1. "splash" runs the Pallas TPU kernel
in the interpreter here (the `interpret` fixture; compiled on a TPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.attention import (
    AttentionLayout,
    attend,
    blockwise_attention,
    causal_attention,
    cudnn_version,
    dot_product_attention,
    index_causal,
    splash_kernel_attention,
)

TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (3e-2, 6e-2)}  # (values, grads), x scale


def make_case(b, t, s, h, g, kd, kind, dtype=jnp.float32, seed=0):
    """(q, k, v, layout, seen_BxT): random inputs and a layout of the given kind."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
        for shape in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd))
    )
    arange_t = np.broadcast_to(np.arange(t), (b, t))
    arange_s = np.broadcast_to(np.arange(s), (b, s))
    if kind == "causal":
        layout = AttentionLayout(arange_t, arange_s)
    elif kind == "segments":  # 3-4 packed documents per row, ids sorted
        cuts = np.sort(rng.choice(np.arange(1, t), (b, 3), replace=False), axis=1)
        seg = (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1)
        layout = AttentionLayout(arange_t, arange_s, seg, seg)
    elif kind == "restart":  # positions restart per document: not index-causal
        pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])
        layout = AttentionLayout(np.broadcast_to(pos, (b, t)), np.broadcast_to(pos, (b, s)))
    elif kind == "cache":  # queries at slots c_b + t over S slots
        offsets = np.linspace(0, s - t, b).astype(int)
        layout = AttentionLayout(offsets[:, None] + arange_t, arange_s)
    elif kind == "padded":  # causal, the last 3 queries of row 0 are padding (see nothing)
        q_pos = np.array(arange_t)
        q_pos[0, -3:] = -1
        layout = AttentionLayout(q_pos, arange_s)
    else:
        raise ValueError(kind)
    layout = AttentionLayout(*(None if x is None else jnp.asarray(x, jnp.int32) for x in layout))
    seen = np.asarray(layout.mask()).any(-1)
    return q, k, v, layout, seen


def ref_and_grads(q, k, v, layout, seen, fn):
    """fn's output and its q/k/v gradients under a cotangent that is zero on unseen rows."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    w = w * jnp.asarray(seen, jnp.float32)[:, :, None, None]

    def loss(q, k, v):
        return (fn(q, k, v).astype(jnp.float32) * w).sum()

    out = fn(q, k, v)
    return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


_reference = jax.jit(
    lambda q, k, v, layout, seen: ref_and_grads(
        q, k, v, layout, seen, lambda q, k, v: causal_attention(q, k, v, layout.mask())
    )
)


def check_against_reference(q, k, v, layout, seen, fn, dtype=jnp.float32, jit=True):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_grads = _reference(*f32, layout, seen)
    runner = jax.jit(ref_and_grads, static_argnums=(5,)) if jit else ref_and_grads
    got, got_grads = runner(q, k, v, layout, seen, fn)
    assert got.shape == q.shape and got.dtype == q.dtype
    vtol, gtol = TOL[dtype]
    rows = seen[:, :, None, None]
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(
        np.where(rows, got.astype(jnp.float32), 0), np.where(rows, want, 0), atol=vtol * scale
    )
    for name, g, wg in zip("qkv", got_grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        gscale = float(jnp.abs(wg).max())
        np.testing.assert_allclose(g.astype(jnp.float32), wg, atol=gtol * gscale, err_msg=name)
    return got


# (B, T, S, H, G, K, kind, dtype, block_size)
CASES = [
    (2, 37, 37, 4, 2, 16, "segments", jnp.float32, 16),
    (2, 37, 37, 4, 1, 8, "causal", jnp.float32, 16),
    (2, 5, 29, 4, 2, 16, "cache", jnp.float32, 8),
    (2, 37, 37, 4, 2, 16, "segments", jnp.bfloat16, 16),
    (2, 21, 21, 4, 2, 8, "padded", jnp.float32, 8),
    (2, 21, 21, 4, 2, 8, "restart", jnp.float32, 8),
]
IDS = [f"{c[6]}-G{c[4]}-{jnp.dtype(c[7]).name}" for c in CASES]
# Slow: the padded and restarting layouts, whose blockwise path stays fast in
# test_fully_masked_rows_* (padded) and test_dot_product_*[restart] (its blockwise branch).
BLOCKWISE = [
    pytest.param(*c, id=i, marks=pytest.mark.slow if c[6] in ("padded", "restart") else ())
    for c, i in zip(CASES, IDS, strict=True)
]


@pytest.mark.parametrize("b,t,s,h,g,kd,kind,dtype,block", BLOCKWISE)
def test_blockwise_matches_reference(b, t, s, h, g, kd, kind, dtype, block):
    q, k, v, layout, seen = make_case(b, t, s, h, g, kd, kind, dtype)
    fn = lambda q, k, v: blockwise_attention(q, k, v, *layout, block_size=block)  # noqa: E731
    check_against_reference(q, k, v, layout, seen, fn, dtype)


def test_jit_equals_eager_and_auto_is_blockwise_on_cpu():
    q, k, v, layout, seen = make_case(2, 37, 37, 4, 2, 16, "segments")
    auto = lambda q, k, v: attend(q, k, v, layout, impl="auto", block_size=16)  # noqa: E731
    eager = attend(q, k, v, layout, impl="blockwise", block_size=16)
    np.testing.assert_array_equal(eager, jax.jit(auto)(q, k, v))
    np.testing.assert_array_equal(eager, auto(q, k, v))
    # Eager gradients too (no outer jit around the custom VJP).
    check_against_reference(q, k, v, layout, seen, auto, jit=False)


def _outputs_and_grads(fn, q, k, v, seen):
    """jit: out, grads under an all-ones cotangent, grads under one zero on unseen rows."""
    w = jnp.asarray(seen, jnp.float32)[:, :, None, None]

    @jax.jit
    def run(q, k, v):
        all_rows = jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))(q, k, v)
        seen_rows = jax.grad(lambda *a: (fn(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        return fn(q, k, v), all_rows, seen_rows

    return run(q, k, v)


@pytest.mark.parametrize("impl", ["blockwise", "dot_product"])
def test_fully_masked_rows_give_zero_output_and_finite_zero_gradients(impl):
    q, k, v, layout, seen = make_case(2, 21, 21, 4, 2, 8, "padded")
    assert not seen[0, -3:].any() and seen[0, :-3].all()
    fn = lambda q, k, v: attend(q, k, v, layout, impl=impl, block_size=8)  # noqa: E731
    out, grads, seen_grads = _outputs_and_grads(fn, q, k, v, seen)
    np.testing.assert_array_equal(out[0, -3:], 0.0)
    # A cotangent on the padding rows must not reach any gradient (and make no NaN).
    for grad in grads:
        assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(grads[0][0, -3:], 0.0)
    for grad, seen_grad in zip(grads[1:], seen_grads[1:], strict=True):
        np.testing.assert_allclose(grad, seen_grad, atol=1e-6)


@pytest.mark.parametrize("impl", ["blockwise", "dot_product"])
def test_fully_masked_decode_row(impl):
    """A decode query that precedes every slot (position -1) sees nothing: 0, no NaN."""
    q, k, v, _, _ = make_case(2, 1, 9, 4, 2, 8, "causal")
    kv_pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    layout = AttentionLayout(jnp.array([[-1], [4]], jnp.int32), kv_pos)
    fn = lambda q, k, v: attend(q, k, v, layout, impl=impl)  # noqa: E731
    out, (dq, dk, dv), _ = _outputs_and_grads(fn, q, k, v, np.array([[False], [True]]))
    np.testing.assert_array_equal(out[0], 0.0)
    for grad in (dq, dk, dv):
        assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(dq[0], 0.0)


# dot_product: the index-causal case runs jax.nn.dot_product_attention (XLA implementation
# here); segments and cache offsets route to blockwise; decode uses key lengths; restarting
# positions fail the on-device check and take the blockwise branch of the cond.
DP_CASES = [
    (2, 37, 37, 4, 2, 16, "causal", jnp.float32, 16),
    (2, 37, 37, 4, 2, 16, "segments", jnp.float32, 16),
    (2, 5, 29, 4, 1, 16, "cache", jnp.float32, 8),
    (2, 1, 29, 4, 2, 16, "cache", jnp.float32, 8),
    (2, 21, 21, 4, 2, 8, "restart", jnp.float32, 8),
    (2, 37, 37, 4, 2, 16, "causal", jnp.bfloat16, 16),
]


@pytest.mark.parametrize(
    "b,t,s,h,g,kd,kind,dtype,block",
    [  # slow: segments, whose blockwise route is test_blockwise_*[segments-*]'s path
        pytest.param(
            *c,
            id=f"{c[6]}-T{c[1]}-G{c[4]}-{jnp.dtype(c[7]).name}",
            marks=pytest.mark.slow if c[6] == "segments" else (),
        )
        for c in DP_CASES
    ],
)
def test_dot_product_matches_reference(b, t, s, h, g, kd, kind, dtype, block):
    q, k, v, layout, seen = make_case(b, t, s, h, g, kd, kind, dtype)
    fn = lambda q, k, v: attend(q, k, v, layout, impl="dot_product", block_size=block)  # noqa: E731
    check_against_reference(q, k, v, layout, seen, fn, dtype)


def test_dot_product_xla_and_cudnn_route_the_same_layouts():
    """The routing does not depend on the implementation: the XLA form is what CPU tests
    check, the cuDNN form only differs in the kernel jax.nn calls (see the lowering tests)."""
    q, k, v, layout, seen = make_case(2, 21, 21, 4, 2, 8, "restart")
    fn = lambda q, k, v: dot_product_attention(q, k, v, layout, implementation="xla")  # noqa: E731
    check_against_reference(q, k, v, layout, seen, fn)


def test_index_causal_predicate():
    _, _, _, causal, _ = make_case(1, 6, 6, 2, 1, 8, "causal")
    _, _, _, segments, _ = make_case(1, 6, 6, 2, 1, 8, "segments")
    _, _, _, restart, _ = make_case(1, 6, 6, 2, 1, 8, "restart")
    assert bool(index_causal(causal)) and bool(index_causal(segments))
    assert not bool(index_causal(restart))
    q_seg = segments.q_segment_ids_BxT.at[0, 0].add(7)  # a query whose own key is hidden
    assert not bool(index_causal(segments._replace(q_segment_ids_BxT=q_seg)))


# splash: T = 150 is padded to 256 (two 128-blocks), GQA over G = 2, packed segments.
def test_splash_kernel_matches_reference(interpret):
    if not interpret and jax.default_backend() != "tpu":
        pytest.skip("splash is a TPU kernel: its compiled twin runs on a TPU")
    q, k, v, layout, seen = make_case(1, 150, 150, 4, 2, 16, "segments")
    fn = lambda q, k, v: splash_kernel_attention(  # noqa: E731
        q, k, v, layout.q_segment_ids_BxT, layout.kv_segment_ids_BxS,
        block_size=128, interpret=interpret,
    )  # fmt: skip
    check_against_reference(q, k, v, layout, seen, fn)


def test_splash_impl_routes_cache_layouts_to_blockwise():
    q, k, v, layout, seen = make_case(2, 5, 29, 4, 2, 16, "cache")
    fn = lambda q, k, v: attend(q, k, v, layout, impl="splash", block_size=128)  # noqa: E731
    check_against_reference(q, k, v, layout, seen, fn)
    jaxpr = str(jax.make_jaxpr(fn)(q, k, v))
    assert "pallas_call" not in jaxpr


# Interpreted (CPU) both kinds are the blockwise path of test_jit_equals_eager_*: segments
# is slow there; its compiled twin stays fast (tests/conftest.py).
@pytest.mark.parametrize("kind", ["causal", pytest.param("segments", marks=pytest.mark.slow)])
def test_auto_matches_reference_on_this_platform(interpret, kind):
    """impl="auto" on the platform the test runs on. Interpreted twin: CPU, so blockwise in
    f32. Compiled twin (GPU/TPU, `scripts/device_check.sh`): the platform's kernel in bf16,
    cuDNN on GPU for the causal layout (packed segments go blockwise), splash on TPU, and
    the lowered program must call it."""
    dtype, t = (jnp.float32, 40) if interpret else (jnp.bfloat16, 256)
    q, k, v, layout, seen = make_case(2, t, t, 4, 2, 64, kind, dtype)
    fn = lambda q, k, v: attend(q, k, v, layout, impl="auto", block_size=128)  # noqa: E731
    check_against_reference(q, k, v, layout, seen, fn, dtype)
    text = jax.jit(fn).lower(q, k, v).as_text()
    backend = jax.default_backend()
    want_tpu = backend == "tpu"
    want_cudnn = backend == "gpu" and kind == "causal" and cudnn_version() is not None
    assert ("tpu_custom_call" in text) == want_tpu
    assert ("__cudnn$fmha" in text) == want_cudnn
