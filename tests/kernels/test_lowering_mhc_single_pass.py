"""The Single-Pass mHC kernels lower for TPU (Mosaic) and CUDA (Triton) from this CPU host.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=(p,))`` runs the Pallas
lowering of platform p here (block-shape rules, Triton tensor sizes; the Mosaic / PTX
compilers themselves run on the device). Shapes are realistic: n = 4 streams, C up to 7168,
8192 tokens, bf16 and f32, forward and value-and-gradient through the custom_vjp.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from v41jax.kernels.mhc_single_pass import mhc_single_pass
from v41jax.kernels.mhc_single_pass.kernel import block_specs
from v41jax.kernels.mhc_single_pass.plan import (
    GPU_SMEM_LIMIT,
    TPU_VMEM_HARD_LIMIT,
    block_traffic,
    gpu_smem_bytes,
    make_plan,
    tpu_vmem_bytes,
)

KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
PALLAS_CALLS = ("tpu_custom_call", "triton", "mosaic_gpu")
WIDTHS = [1024, 4096, 7168]
# The widths of the lowering grids: the smallest and the largest stay fast, the middle one
# (its tiling is that of 1024's, with more C tiles) is slow.
WIDTH_PARAMS = [pytest.param(c, marks=pytest.mark.slow if c == 4096 else ()) for c in WIDTHS]
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
TOKENS = 8192
N = 4


def _args(tokens, n, c, dtype, stats=True, norm=True):
    s = jax.ShapeDtypeStruct
    f32 = jnp.float32
    k = n * n + 2 * n
    return (
        s((tokens, n, c), dtype),
        s((tokens, c), dtype),
        s((tokens, n, n), f32),
        s((tokens, n), f32),
        s((tokens, n), f32),
        s((n * c, k), f32) if stats else None,
        s((c,), f32) if norm else None,
    )


def _lowered(fn, args, platforms) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def _step(impl, **kw):
    return lambda *a: mhc_single_pass(*a, impl=impl, **kw)


def _value_and_grad(impl, **kw):
    def loss(*a):
        x, h, proj, sumsq = mhc_single_pass(*a, impl=impl, **kw)
        f = lambda v: jnp.sum(v.astype(jnp.float32) ** 2)
        return f(x) + f(h) + f(proj) + f(sumsq)

    # value_and_grad: with grad alone the forward's outputs are dead code (the backward
    # recomputes the XLA form), and the kernel would be pruned from the program.
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("c", WIDTH_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_forward_lowers_to_the_platform_kernel(platform, c, dtype, impl):
    text = _lowered(_step(impl), _args(TOKENS, N, c, DTYPES[dtype]), (platform,))
    assert KERNEL_CALL[platform] in _custom_calls(text)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("c", WIDTH_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_value_and_gradient_lower_to_the_platform_kernel(platform, c, dtype):
    text = _lowered(_value_and_grad("auto"), _args(TOKENS, N, c, DTYPES[dtype]), (platform,))
    assert KERNEL_CALL[platform] in _custom_calls(text)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("stats,norm", [(False, True), (True, False), (False, False)])
def test_optional_outputs_lower(platform, stats, norm):
    args = _args(TOKENS, N, 4096, jnp.bfloat16, stats=stats, norm=norm)
    assert KERNEL_CALL[platform] in _custom_calls(_lowered(_step("pallas"), args, (platform,)))


def test_auto_lowered_for_cpu_has_no_pallas_call():
    for fn in (_step("auto"), _value_and_grad("auto")):
        calls = _custom_calls(_lowered(fn, _args(64, N, 1024, jnp.float32), ("cpu",)))
        assert not any(p in call for call in calls for p in PALLAS_CALLS), calls


def test_one_program_lowered_for_several_platforms():
    """Each platform's rule is lowered only for its platform: one module holds both kernels
    and the CPU XLA form (lax.platform_dependent would lower the kernels for CPU too)."""
    text = _lowered(_step("auto"), _args(256, N, 1024, jnp.bfloat16), ("cpu", "tpu", "cuda"))
    assert {KERNEL_CALL["tpu"], KERNEL_CALL["cuda"]} <= _custom_calls(text)


def test_pallas_lowered_for_cpu_raises_clear_error():
    with pytest.raises(ValueError, match=r"impl='pallas' was lowered for .*CPU.*interpret=True"):
        _lowered(_step("pallas"), _args(64, N, 1024, jnp.float32), ("cpu",))


def test_odd_width_errors_for_the_gpu_kernel_and_falls_back_under_auto():
    """C = 1000 has no power-of-two tile >= 16: the GPU kernel refuses it when lowered for
    CUDA, naming the limit; the TPU kernel takes it (one tile, C = the full width)."""
    args = _args(TOKENS, N, 1000, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"gpu kernel.*C=1000 needs a power-of-two tile"):
        _lowered(_step("pallas"), args, ("cuda",))
    assert KERNEL_CALL["tpu"] in _custom_calls(_lowered(_step("pallas"), args, ("tpu",)))
    calls = _custom_calls(_lowered(_step("auto"), args, ("cuda",)))
    assert not any("triton" in call for call in calls), calls


def test_shape_no_kernel_takes_raises_before_lowering():
    with pytest.raises(ValueError, match=r"block_c=100 must be a multiple of 128.*power-of-two"):
        jax.jit(_step("pallas", block_c=100)).trace(*_args(TOKENS, N, 1000, jnp.float32))


@pytest.mark.parametrize("target", ["tpu", "gpu"])
@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_block_spec_traffic_within_bound_and_memory_fits(target, c, dtype):
    """HBM bytes per token from the kernel's block specs <= 1.1 x the (2n+2)C bound, and the
    chosen tiles fit TPU VMEM (under the explicit limit) / GPU shared memory."""
    item = jnp.dtype(DTYPES[dtype]).itemsize
    k = N * N + 2 * N
    plan = make_plan(
        target,
        num=TOKENS,
        n=N,
        c=c,
        k=k,
        x_item=item,
        out_item=item,
        with_norm=True,
        norm_eps=1e-6,
        out_dtype=DTYPES[dtype],
    )
    grid, ins, outs = block_specs(plan, TOKENS, N, c, k, DTYPES[dtype], True)
    per_token = block_traffic(grid, ins + outs) / TOKENS
    bound = (2 * N + 2) * c * item
    assert bound <= per_token <= 1.1 * bound
    if target == "tpu":
        need = tpu_vmem_bytes(plan.block_tokens, plan.block_c, N, c, k, item, item, True, True)
        assert need < plan.vmem_limit_bytes <= TPU_VMEM_HARD_LIMIT
    else:
        assert gpu_smem_bytes(plan.block_tokens, plan.block_c, plan.pad_k_to, True) <= (
            GPU_SMEM_LIMIT
        )
    assert c % plan.block_c == 0 and plan.block_c < c


def test_tpu_module_carries_the_cost_estimate():
    """The Mosaic call carries ``pl.CostEstimate``: bytes = the block-spec traffic (the
    Triton lowering has no field for it; the estimate is built the same way there)."""
    text = _lowered(_step("pallas"), _args(TOKENS, N, 1024, jnp.float32), ("tpu",))
    got = re.search(r"bytes_accessed\\22:(\d+)", text)
    assert got, "no cost estimate in the TPU custom call"
    k = N * N + 2 * N
    plan = make_plan(
        "tpu",
        num=TOKENS,
        n=N,
        c=1024,
        k=k,
        x_item=4,
        out_item=4,
        with_norm=True,
        norm_eps=1e-6,
        out_dtype=jnp.float32,
    )
    grid, ins, outs = block_specs(plan, TOKENS, N, 1024, k, jnp.float32, True)
    assert int(got.group(1)) == block_traffic(grid, ins + outs)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_vmapped_step_lowers_to_the_platform_kernel(platform):
    """Under vmap each platform's function is vmapped (the kernel gets a batch grid axis)."""
    x, y, h_res, h_post, a_pre, phi, g = _args(512, N, 1024, jnp.bfloat16)
    batched = [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in (x, y, h_res, h_post, a_pre)]
    step = lambda *a: mhc_single_pass(*a, impl="auto")
    fn = jax.vmap(step, in_axes=(0,) * 5 + (None,) * 2)
    text = _lowered(fn, (*batched, phi, g), (platform,))
    assert KERNEL_CALL[platform] in _custom_calls(text)
