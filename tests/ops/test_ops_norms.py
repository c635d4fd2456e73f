"""v41jax.ops RMSNorm against a plain NumPy (float64) reference: odd sizes, bf16, the folded
forms, and the exact order of operations callers rely on."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax import ops


def _np_rms_norm(x, scale, eps):
    x64 = np.asarray(x, np.float64)
    r = np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps)
    return x64 / r * np.asarray(scale, np.float64)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 129), (2, 1, 4, 33)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_f32_matches_numpy(shape, eps):
    kx, ks = jax.random.split(jax.random.key(sum(shape)))
    x = 3.0 * jax.random.normal(kx, shape)
    scale = 1.0 + 0.1 * jax.random.normal(ks, shape[-1:])
    out = ops.rms_norm_f32(x, scale, eps)
    assert out.dtype == jnp.float32 and out.shape == shape
    np.testing.assert_allclose(out, _np_rms_norm(x, scale, eps), rtol=1e-5, atol=1e-6)
    same_dtype = ops.rms_norm(x, scale, eps)
    assert same_dtype.dtype == jnp.float32
    np.testing.assert_array_equal(same_dtype, out)


@pytest.mark.parametrize("d", [5, 64, 257])
def test_bf16_input_is_normalised_in_float32(d):
    x = (8.0 * jax.random.normal(jax.random.key(d), (4, d))).astype(jnp.bfloat16)
    scale = jnp.linspace(0.5, 1.5, d, dtype=jnp.bfloat16)
    out = ops.rms_norm(x, scale, 1e-6)
    assert out.dtype == jnp.bfloat16
    f32 = ops.rms_norm_f32(x, scale, 1e-6)
    assert f32.dtype == jnp.float32
    # The float32 result rounded once to bf16: no bf16 arithmetic in between.
    np.testing.assert_array_equal(out, f32.astype(jnp.bfloat16))
    ref = _np_rms_norm(np.asarray(x, np.float32), np.asarray(scale, np.float32), 1e-6)
    np.testing.assert_allclose(f32, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=2**-7, atol=1e-2)


def test_order_of_operations_is_x_times_inv_then_scale():
    """Callers' numbers depend on `(x * inv_rms) * scale` in float32; pin it bit for bit."""
    x = jax.random.normal(jax.random.key(1), (3, 2, 48)).astype(jnp.bfloat16)
    scale = jax.random.uniform(jax.random.key(2), (48,), minval=0.5, maxval=2.0)
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_array_equal(ops.rms_norm_f32(x, scale, 1e-6), x32 * inv * scale)
    np.testing.assert_array_equal(ops.inv_rms(x, 1e-6), inv)


def test_eps_sits_inside_the_sqrt():
    np.testing.assert_array_equal(ops.rms_norm_f32(jnp.zeros((2, 9)), jnp.ones(9), 1e-6), 0.0)
    c, eps = 1e-3, 1e-6
    out = ops.rms_norm_f32(jnp.full((11,), c), jnp.ones(11), eps)
    np.testing.assert_allclose(out, c / np.sqrt(c * c + eps), rtol=1e-6)


def test_broadcast_scale_per_branch():
    x = jax.random.normal(jax.random.key(3), (2, 5, 3, 17))
    scale = jax.random.normal(jax.random.key(4), (3, 17))
    np.testing.assert_allclose(
        ops.rms_norm_f32(x, scale, 1e-6), _np_rms_norm(x, scale, 1e-6), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("d", [1, 31, 96])
def test_inv_rms_forms_agree(d):
    x = jax.random.normal(jax.random.key(d), (4, 3, d))
    inv = ops.inv_rms(x, 1e-6)
    assert inv.shape == (4, 3, 1) and inv.dtype == jnp.float32
    np.testing.assert_allclose(
        inv[..., 0], 1.0 / np.sqrt(np.mean(np.float64(x) ** 2, -1) + 1e-6), rtol=1e-6
    )
    sumsq = jnp.sum(jnp.square(x), axis=-1)
    np.testing.assert_array_equal(ops.inv_rms_from_sumsq(sumsq, d, 1e-6), inv[..., 0])


def test_folded_scale_equals_norm_then_project():
    """RMSNorm(v; g) phi == (v (g ⊙ phi)) * inv_rms(v): the form mHC's coefficients use."""
    kv, kg, kp = jax.random.split(jax.random.key(5), 3)
    v, g, phi = (
        jax.random.normal(kv, (6, 40)),
        jax.random.normal(kg, (40,)),
        jax.random.normal(kp, (40, 7)),
    )
    hi = jax.lax.Precision.HIGHEST
    direct = jnp.matmul(ops.rms_norm_f32(v, g, 1e-6), phi, precision=hi)
    folded = jnp.matmul(v, g[:, None] * phi, precision=hi) * ops.inv_rms(v, 1e-6)
    np.testing.assert_allclose(direct, folded, rtol=1e-5, atol=1e-5)


def test_grad_matches_numpy_finite_difference():
    x = jax.random.normal(jax.random.key(6), (13,))
    scale = jnp.linspace(0.5, 1.5, 13)

    def loss(x64):
        return float(np.sum(np.sin(_np_rms_norm(x64, scale, 1e-6))))

    g = jax.grad(lambda x: jnp.sum(jnp.sin(ops.rms_norm(x, scale, 1e-6))))(x)
    x64, h = np.asarray(x, np.float64), 1e-6
    fd = [(loss(x64 + h * e) - loss(x64 - h * e)) / (2 * h) for e in np.eye(13)]
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-4)


def test_ops_imports_only_jax():
    """The bottom layer: importing v41jax.ops loads no flax and nothing else from v41jax."""
    code = (
        "import sys, v41jax.ops\n"
        "mods = [m for m in sys.modules if m.startswith('flax')\n"
        "        or (m.startswith('v41jax.') and not m.startswith('v41jax.ops'))]\n"
        "assert not mods, mods\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
