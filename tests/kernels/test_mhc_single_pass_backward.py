"""The fused Single-Pass mHC backward kernel (``backward.py``): its gradients equal the
reference's (autodiff of ``single_pass_step_reference``) in fp32 and bf16, n = 1..4, odd
token counts and C, one and several C tiles, with and without phi / the norm, in both kernel
variants (interpreted here); and its block-spec traffic is within 1.15x of the backward's
bound (TPU: the bound itself; GPU: plus the atomic adds of dphi)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.mhc_single_pass import mhc_single_pass, single_pass_step_reference
from v41jax.kernels.mhc_single_pass.backward import (
    backward_bound_bytes,
    backward_traffic,
    make_backward_plan,
)

# tests import as files (--import-mode=importlib): the forward tests' module by path
_FORWARD = pathlib.Path(__file__).parent / "test_mhc_single_pass.py"
_spec = importlib.util.spec_from_file_location("mhc_single_pass_forward_tests", _FORWARD)
forward_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forward_tests)

# (target, lead, n, C, dtype, with_phi, with_norm, block_tokens, block_c)
CASES = [
    ("tpu", (13,), 4, 384, "f32", True, True, 8, 128),  # 3 C tiles, a ragged token block
    ("tpu", (7,), 3, 40, "f32", True, True, None, None),  # C not a multiple of 128
    ("tpu", (2, 9), 2, 256, "bf16", True, True, 8, 128),
    ("tpu", (5,), 1, 64, "f32", False, False, None, None),
    ("tpu", (11,), 4, 128, "bf16", False, True, None, None),
    ("gpu", (37,), 4, 96, "f32", True, True, 16, 32),  # 3 C tiles, tokens padded to 48
    ("gpu", (7,), 3, 32, "bf16", True, True, 16, 16),
    ("gpu", (3, 7), 2, 64, "f32", False, True, None, None),
]
IDS = [f"{t}-{'x'.join(map(str, lead))}-n{n}-C{c}-{d}-{'phi' if p else 'nophi'}-"
       f"{'norm' if g else 'nonorm'}" for t, lead, n, c, d, p, g, _, _ in CASES]  # fmt: skip
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _inputs(lead, n, c, dtype, with_phi, with_norm, seed=0):
    """test_mhc_single_pass's inputs, less phi and / or the norm scale."""
    x, y, h_res, h_post, a_pre, phi, g = forward_tests._inputs(lead, n, c, seed=seed, dtype=dtype)
    return x, y, h_res, h_post, a_pre, phi if with_phi else None, g if with_norm else None


def _grads(fn, args, cot_seed=1):
    """Gradients of a random linear function of every output, for every input present."""
    rng = np.random.default_rng(cot_seed)
    present = tuple(i for i, a in enumerate(args) if a is not None)

    def loss(*arrays):
        full = list(args)
        for i, a in zip(present, arrays, strict=True):
            full[i] = a
        total = 0.0
        for out in fn(*full):
            if out is not None:
                w = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
                total = total + jnp.sum(out.astype(jnp.float32) * w)
        return total

    # traced once: the cotangents are drawn in output order, the same for every fn
    return jax.grad(loss, argnums=tuple(range(len(present))))(*(args[i] for i in present))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_backward_equals_the_reference_gradient(case):
    target, lead, n, c, dt, with_phi, with_norm, bt, bc = case
    args = _inputs(lead, n, c, DTYPES[dt], with_phi, with_norm)
    kernel = lambda *a: mhc_single_pass(
        *a, impl="pallas", interpret=True, pallas_target=target, block_tokens=bt, block_c=bc
    )
    got = _grads(kernel, args)
    want = _grads(single_pass_step_reference, args)
    # bf16: the reference rounds the streams' cotangent to bf16 before it reaches X, y and
    # the coefficients (autodiff through the cast); the kernel keeps it in f32
    tol = 1e-5 if dt == "f32" else 1.5e-2
    assert len(got) == len(want) == sum(a is not None for a in args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = max(float(np.abs(w32).max()), 1e-6)
        np.testing.assert_allclose(g32, w32, atol=tol * scale, rtol=0)


def test_a_wrong_backward_is_caught():
    """Negative control for the comparison above: the reference with its norm eps changed
    (a different function) differs from the kernel by more than the f32 tolerance."""
    args = _inputs((13,), 4, 384, jnp.float32, True, True)
    kernel = lambda *a: mhc_single_pass(*a, impl="pallas", interpret=True, norm_eps=1e-6)
    other = lambda *a: single_pass_step_reference(*a, norm_eps=1.0)
    got, want = _grads(kernel, args), _grads(other, args)
    worst = max(
        float(np.abs(np.asarray(g) - np.asarray(w)).max() / np.abs(np.asarray(w)).max())
        for g, w in zip(got, want, strict=True)
    )
    assert worst > 1e-3


@pytest.mark.parametrize("target", ["tpu", "gpu"])
@pytest.mark.parametrize("c", [1024, 4096, 7168])
@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_block_spec_traffic_is_within_1_15_of_the_bound(target, c, dt):
    """Per token at 8,192 tokens a chip, n = 4, K = 24, with the norm: the TPU kernel moves
    every block once (the bound, plus phi / dphi / dg once per call); the GPU kernel adds
    the atomic adds of dphi and dg, n C Kp 4 bytes per 128-token program (at 1,024 tokens
    a GPU, phi and dphi once per call add 0.03x more: 1.151x in bf16)."""
    n, k, num = 4, 24, 8192
    item = jnp.dtype(DTYPES[dt]).itemsize
    plan = make_backward_plan(target, num=num, n=n, c=c, k=k, x_item=item, h_item=item,
                              with_norm=True, norm_eps=1e-6)  # fmt: skip
    moved = backward_traffic(plan, num, n, c, DTYPES[dt], DTYPES[dt], True, True) / num
    bound = backward_bound_bytes(n, c, k, item, item, True)
    assert bound <= moved <= 1.15 * bound, (moved / bound, plan)


def test_bad_backward_tiles_are_refused_by_name():
    with pytest.raises(ValueError, match="block_c=100 must divide C=384"):
        make_backward_plan("tpu", num=8, n=4, c=384, k=24, x_item=4, h_item=4,
                           with_norm=True, norm_eps=1e-6, block_c=100)  # fmt: skip
    with pytest.raises(ValueError, match="block_tokens=8 must be a power of two >= 16"):
        make_backward_plan("gpu", num=8, n=4, c=384, k=24, x_item=4, h_item=4,
                           with_norm=True, norm_eps=1e-6, block_tokens=8)  # fmt: skip
    with pytest.raises(ValueError, match="C=1000 needs a power-of-two tile"):
        make_backward_plan("gpu", num=8, n=4, c=1000, k=24, x_item=4, h_item=4,
                           with_norm=True, norm_eps=1e-6)  # fmt: skip
