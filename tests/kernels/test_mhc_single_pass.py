"""Single-Pass mHC step kernel: XLA, the Pallas kernels and the reference agree.

Odd sizes: n=3, token counts that are not a block multiple (7, 37; [2, 5]), C not a
multiple of 128 (13, one tile) and several C tiles (384 / 128 on the TPU kernel, 96 / 32 on
the GPU one). The Pallas tests take the ``interpret`` fixture: interpreted here (each kernel
variant via ``pallas_target``), compiled on an accelerator (the variant of that platform).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.mhc_single_pass import mhc_single_pass, single_pass_step_reference


def accelerator_platform() -> str | None:
    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else None


SHAPES = [((7,), 3, 13), ((2, 5), 4, 16)]
# (pallas_target, lead, n, C, block_tokens, block_c)
CASES = [
    ("tpu", (7,), 3, 13, 8, None),
    ("tpu", (2, 5), 4, 16, 8, None),
    ("tpu", (37,), 4, 384, 16, 128),
    ("gpu", (7,), 3, 32, 16, 16),
    ("gpu", (2, 5), 4, 16, 16, None),
    ("gpu", (37,), 4, 96, 16, 32),
]
CASE_IDS = [f"{t}-{'x'.join(map(str, lead))}-n{n}-C{c}" for t, lead, n, c, _, _ in CASES]


def _inputs(lead, n, c, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    k = n * n + 2 * n
    return (
        f(*lead, n, c).astype(dtype),
        f(*lead, c).astype(dtype),
        jax.nn.softmax(f(*lead, n, n), axis=-1),
        2 * jax.nn.sigmoid(f(*lead, n)),
        jax.nn.sigmoid(f(*lead, n)),
        f(n * c, k) / np.sqrt(n * c),
        1.0 + 0.1 * f(c),
    )


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _pallas(case, interpret):
    """The kernel call of a case; compiled, only the accelerator's own variant runs."""
    target, _, _, _, bt, bc = case
    if not interpret and target != accelerator_platform():
        pytest.skip(f"compiled {target} kernel: not this accelerator")
    opts = dict(impl="pallas", interpret=interpret, pallas_target=target)
    return lambda *a, **kw: mhc_single_pass(*a, block_tokens=bt, block_c=bc, **opts, **kw)


def _check_outputs(out, ref, lead, n, c, with_phi, tol):
    assert out[0].shape == (*lead, n, c) and out[1].shape == (*lead, c)
    if with_phi:
        assert out[2].shape == (*lead, n * n + 2 * n) and out[3].shape == lead
    else:
        assert out[2] is None and out[3] is None
    for a, b in zip(out, ref, strict=True):
        if b is not None:
            _close(a, b, tol)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("lead,n,c", SHAPES)
@pytest.mark.parametrize("with_phi,with_norm", [(True, True), (False, False)])
def test_forward_matches_reference(impl, lead, n, c, with_phi, with_norm):
    x, y, h_res, h_post, a_pre, phi, g = _inputs(lead, n, c)
    args = (x, y, h_res, h_post, a_pre, phi if with_phi else None, g if with_norm else None)
    out = mhc_single_pass(*args, impl=impl)
    tol = dict(rtol=2e-5, atol=2e-5)
    _check_outputs(out, single_pass_step_reference(*args), lead, n, c, with_phi, tol)


# Without phi and norm every case is fast; with both, one case per kernel (odd tokens and
# several C tiles on each) is, the rest are slow in the interpreter.
FORWARD = [
    pytest.param(
        phi, norm, case, id=f"{phi}-{norm}-{cid}",
        marks=[] if not phi or cid in ("tpu-37-n4-C384", "gpu-7-n3-C32") else pytest.mark.slow,
    )
    for phi, norm in [(True, True), (False, False)]
    for case, cid in zip(CASES, CASE_IDS, strict=True)
]  # fmt: skip


@pytest.mark.parametrize("with_phi,with_norm,case", FORWARD)
def test_pallas_forward_matches_reference(interpret, case, with_phi, with_norm):
    _, lead, n, c, _, _ = case
    x, y, h_res, h_post, a_pre, phi, g = _inputs(lead, n, c)
    args = (x, y, h_res, h_post, a_pre, phi if with_phi else None, g if with_norm else None)
    out = _pallas(case, interpret)(*args)
    tol = dict(rtol=2e-5, atol=2e-5)
    _check_outputs(out, single_pass_step_reference(*args), lead, n, c, with_phi, tol)


@pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=[CASE_IDS[2], CASE_IDS[5]])
def test_pallas_bf16_stream_and_compute_dtype(interpret, case):
    _, lead, n, c, _, _ = case
    args = _inputs(lead, n, c, seed=1, dtype=jnp.bfloat16)
    out = _pallas(case, interpret)(*args)
    ref = single_pass_step_reference(*args)
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == jnp.bfloat16
    assert out[2].dtype == jnp.float32
    # bf16: one ulp of X_{l+1} (summation order); the GPU kernel rounds h twice.
    for a, b in zip(out, ref, strict=True):
        _close(a, b, dict(rtol=2e-2, atol=2e-2))


def test_xla_bf16_stream():
    args = _inputs((7,), 4, 13, seed=1, dtype=jnp.bfloat16)
    out = mhc_single_pass(*args, impl="xla")
    assert out[0].dtype == jnp.bfloat16 and out[2].dtype == jnp.float32
    for a, b in zip(out, single_pass_step_reference(*args), strict=True):
        _close(a, b, dict(rtol=2e-2, atol=2e-2))


def _loss(fn, *a):
    x_new, h, proj, sumsq = fn(*a)
    return (
        jnp.sum(jnp.sin(x_new))
        + jnp.sum(jnp.cos(h))
        + jnp.sum(jnp.tanh(proj))
        + 1e-2 * jnp.sum(sumsq)
    )


def _check_grads(fn, args):
    g_ours = jax.grad(lambda *a: _loss(fn, *a), argnums=tuple(range(7)))(*args)
    g_ref = jax.grad(lambda *a: _loss(single_pass_step_reference, *a), argnums=tuple(range(7)))(
        *args
    )
    for a, b in zip(g_ours, g_ref, strict=True):
        _close(a, b, dict(rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize(
    "impl,lead,n,c",
    [
        pytest.param("xla", *SHAPES[0], id="xla-lead0-3-13"),
        pytest.param("xla", *SHAPES[1], id="xla-lead1-4-16", marks=pytest.mark.slow),
        pytest.param("auto", *SHAPES[0], id="auto-lead0-3-13", marks=pytest.mark.slow),
        pytest.param("auto", *SHAPES[1], id="auto-lead1-4-16"),
    ],
)
def test_gradients_match_reference(impl, lead, n, c):
    _check_grads(lambda *a: mhc_single_pass(*a, impl=impl), _inputs(lead, n, c, seed=2))


def test_auto_under_vmap_matches_xla():
    """impl="auto" (the platform dispatch) under vmap, here the CPU rule: the XLA form."""
    x, y, h_res, h_post, a_pre, phi, g = _inputs((3, 5), 4, 16, seed=4)
    fn = lambda *a: mhc_single_pass(*a, phi, g, impl="auto")
    out = jax.vmap(fn)(x, y, h_res, h_post, a_pre)
    ref = mhc_single_pass(x, y, h_res, h_post, a_pre, phi, g, impl="xla")
    for a, b in zip(out, ref, strict=True):
        _close(a, b, dict(rtol=2e-5, atol=2e-5))


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(CASES[0], id=CASE_IDS[0]),
        pytest.param(CASES[3], id=CASE_IDS[3]),  # the GPU kernel, 2 C tiles: fast
        pytest.param(CASES[5], id=CASE_IDS[5], marks=pytest.mark.slow),  # 3 x 3 blocks
    ],
)
def test_pallas_gradients_match_reference(interpret, case):
    _, lead, n, c, _, _ = case
    _check_grads(_pallas(case, interpret), _inputs(lead, n, c, seed=2))


def test_jit_pallas_matches_xla(interpret):
    case = ("tpu", (7,), 4, 13, 8, None) if interpret else CASES[0]
    if not interpret and accelerator_platform() == "gpu":
        case = CASES[3]
    args = _inputs(*case[1:4], seed=3)
    f = jax.jit(_pallas(case, interpret))
    for a, b in zip(f(*args), mhc_single_pass(*args, impl="xla"), strict=True):
        _close(a, b, dict(rtol=2e-5, atol=2e-5))


def test_bad_shapes_and_options_raise():
    x, y, h_res, h_post, a_pre, phi, g = _inputs((7,), 4, 13)
    with pytest.raises(ValueError, match=r"y must have shape \(7, 13\)"):
        mhc_single_pass(x, y[:, :5], h_res, h_post, a_pre)
    with pytest.raises(ValueError, match="h_res must have shape"):
        mhc_single_pass(x, y, h_res[:, :3], h_post, a_pre)
    with pytest.raises(ValueError, match=r"phi must be \[n\*C, K\]"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, phi[:10])
    with pytest.raises(ValueError, match="norm_scale must be"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, phi, g[:4])
    with pytest.raises(ValueError, match="at least one token axis"):
        mhc_single_pass(x[0], y[0], h_res[0], h_post[0], a_pre[0])
    with pytest.raises(ValueError, match="impl must be one of"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="cuda")
    with pytest.raises(ValueError, match="block_tokens"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="pallas", interpret=True, block_tokens=0)
    with pytest.raises(ValueError, match="pallas_target must be one of"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="pallas", pallas_target="cuda")


def test_kernel_limits_raise_clear_errors():
    x, y, h_res, h_post, a_pre, phi, g = _inputs((7,), 4, 13)
    args = (x, y, h_res, h_post, a_pre, phi, g)
    run = lambda target, **kw: mhc_single_pass(
        *args, impl="pallas", interpret=True, pallas_target=target, **kw
    )
    with pytest.raises(ValueError, match=r"gpu kernel.*C=13 needs a power-of-two tile"):
        run("gpu")
    with pytest.raises(ValueError, match=r"block_tokens=4 must be a multiple of 8"):
        run("tpu", block_tokens=4)
    with pytest.raises(ValueError, match=r"block_tokens=8 must be >= 16 with statistics"):
        run("gpu", block_tokens=8)
    with pytest.raises(ValueError, match=r"C=13 is not a multiple of block_c=8"):
        run("tpu", block_c=8)
    # Huge C: phi alone overflows VMEM. Checked while tracing, nothing is allocated.
    n, c, k = 4, 1 << 18, 24
    s = jax.ShapeDtypeStruct
    big = (s((64, n, c), jnp.float32), s((64, c), jnp.float32), s((64, n, n), jnp.float32))
    big += (s((64, n), jnp.float32), s((64, n), jnp.float32), s((n * c, k), jnp.float32))
    with pytest.raises(ValueError, match=r"tpu kernel.*VMEM need \d+ bytes .* exceeds the limit"):
        jax.eval_shape(
            lambda *a: mhc_single_pass(*a, impl="pallas", interpret=True, pallas_target="tpu"),
            *big,
        )


@pytest.mark.skipif(accelerator_platform() is not None, reason="CPU-only behaviour")
def test_pallas_on_cpu_needs_interpret():
    x, y, h_res, h_post, a_pre, _, _ = _inputs((7,), 4, 16)
    with pytest.raises(ValueError, match="interpret=True"):
        mhc_single_pass(x, y, h_res, h_post, a_pre, impl="pallas")
