"""Speculative verification lowered from this CPU host for TPU (Mosaic), CUDA (Triton), CPU.

Real scale without allocating (``jax.ShapeDtypeStruct``): B = 128 rows, K = 7 drafts,
V = 129,280 (not a multiple of any block: the last block is ragged), with draft laws and
one-hot drafts, f32 and bf16 probabilities; plus an odd shape (B = 3, K = 1, V = 37). The
op has no gradient (integer outputs). Asserted: impl="auto" lowers to the intended kernel
per platform (none for CPU), each kernel lowers at scale, a block a kernel cannot take is
a ValueError naming the limit (before lowering for the kernels, at lowering for the
platform under impl="pallas").
"""

import jax
import jax.numpy as jnp
import pytest

from v41jax.kernels.spec_verify import spec_verify
from v41jax.kernels.spec_verify.kernel import spec_verify_blocked, spec_verify_rowloop

S = jax.ShapeDtypeStruct
TPU_CALL, GPU_CALL = "tpu_custom_call", "__gpu$xla.gpu.triton"
KERNEL_CALL = {"tpu": TPU_CALL, "cuda": GPU_CALL}
B, K, V = 128, 7, 129_280


def _args(b=B, k=K, v=V, dtype=jnp.float32, with_q=True):
    """(draft_tokens, draft_probs | None, target_probs, verify_len, accept_u, race_u)."""
    q = S((b, k, v), dtype) if with_q else None
    i32, f32 = jnp.int32, jnp.float32
    return S((b, k), i32), q, S((b, k + 1, v), dtype), S((b,), i32), S((b, k), f32), S((b, v), f32)


def _lower(fn, args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _custom_calls(text: str) -> set[str]:
    return {c for c in (TPU_CALL, GPU_CALL) if c in text}


CASES = {
    "f32_q": _args(),
    "bf16_onehot": _args(dtype=jnp.bfloat16, with_q=False),
    "odd_b3_k1_v37": _args(3, 1, 37),
}


@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_auto_lowers_to_the_platform_kernel(platform, case):
    text = _lower(lambda *a: spec_verify(*a), CASES[case], platform)
    want = {KERNEL_CALL[platform]} if platform in KERNEL_CALL else set()
    assert _custom_calls(text) == want
    if platform == "cpu":
        assert "custom_call" not in text  # the reference, no Pallas branch
    if platform == "tpu":
        assert "cost_estimate" in text and "transcendentals" in text


def test_one_program_per_platform_from_one_function():
    traced = jax.jit(lambda *a: spec_verify(*a, impl="pallas")).trace(*CASES["f32_q"])
    assert _custom_calls(traced.lower(lowering_platforms=("tpu",)).as_text()) == {TPU_CALL}
    assert _custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text()) == {GPU_CALL}
    # impl="pallas" with interpret=None lowered for CPU: the interpreted blocked kernel.
    assert "custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_v", [128, 1024])
def test_kernels_lower_at_scale(case, block_v):
    args = CASES[case]
    v = args[2].shape[-1]
    blocked = lambda *a: spec_verify_blocked(*a, vocab_size=v, block_v=block_v)  # noqa: E731
    assert TPU_CALL in _lower(blocked, args, "tpu")
    rowloop = lambda *a: spec_verify_rowloop(*a, vocab_size=v, block_v=block_v)  # noqa: E731
    assert GPU_CALL in _lower(rowloop, args, "cuda")


def test_whole_row_block_gets_a_vmem_limit():
    """block_v = V: p, q, w blocks of 129,280 columns (~24 MiB double-buffered) are over
    the default scoped VMEM, so the call carries an explicit limit; 1024 does not."""
    fn = lambda bv: lambda *a: spec_verify_blocked(*a, vocab_size=V, block_v=bv)  # noqa: E731
    assert "scoped_memory_configs" in _lower(fn(V), CASES["f32_q"], "tpu")
    assert "scoped_memory_configs" not in _lower(fn(1024), CASES["f32_q"], "tpu")


@pytest.mark.parametrize(
    "kernel,k,block_v,match",
    [
        (spec_verify_rowloop, K, 384, "power of two on GPU, got 384"),
        (spec_verify_rowloop, K, 1 << 21, "2097152 is over Triton's 1048576 elements"),
        (spec_verify_blocked, K, 1000, r"multiple of 128 \(TPU lanes\) or >= V = 129280.*1000"),
        (spec_verify_blocked, 31, V, r"= 129280 at K = 31 needs \d+ bytes of VMEM .*48 MiB limit"),
    ],
)
def test_block_a_kernel_cannot_take_raises_before_lowering(kernel, k, block_v, match):
    fn = lambda *a: kernel(*a, vocab_size=V, block_v=block_v)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        jax.jit(fn).trace(*_args(k=k))  # at trace time, nothing lowered


def test_pallas_block_a_platform_cannot_take_raises_when_lowered_for_it():
    """block_v = 384 fits the TPU kernel (3 x 128 lanes) but not Triton (not 2^n)."""
    traced = jax.jit(lambda *a: spec_verify(*a, impl="pallas", block_v=384)).trace(*_args())
    assert TPU_CALL in traced.lower(lowering_platforms=("tpu",)).as_text()
    with pytest.raises(ValueError, match=r"power of two on GPU, got 384.*lowered for 'cuda'"):
        traced.lower(lowering_platforms=("cuda",))
    compiled = jax.jit(lambda *a: spec_verify(*a, impl="pallas", interpret=False))
    with pytest.raises(ValueError, match="on CPU needs interpret=True"):
        compiled.trace(*_args()).lower(lowering_platforms=("cpu",))
    # "auto" falls back to the reference where the given block does not fit.
    auto = jax.jit(lambda *a: spec_verify(*a, block_v=384)).trace(*_args())
    assert _custom_calls(auto.lower(lowering_platforms=("cuda",)).as_text()) == set()
