"""Engram lookup lowered from this CPU host for TPU (Mosaic), CUDA (Triton) and CPU.

Real scale without allocating (``jax.ShapeDtypeStruct``): a 2^24-row, 256-wide FP8 table
(4 GiB) with its row scales, 8192 tokens x 24 heads; plus an odd shape (999,983 rows,
bf16, 3 x 1001 tokens x 7 heads). Lowering runs the Pallas -> Mosaic / Triton lowering
(block shapes, tensor sizes), not the device compilers (those run in
tests/aot/test_aot_engram.py, with the ``aot`` extra). Asserted: the lowered program of
impl="auto" holds the intended kernel's custom call for each platform and no Pallas call
for CPU; gradients lower; a shape a kernel cannot take is a ValueError naming the limit.
"""

import jax
import jax.numpy as jnp
import pytest

from v41jax.kernels.engram_lookup import engram_lookup
from v41jax.kernels.engram_lookup.kernel import engram_lookup_dma, engram_lookup_vector

S = jax.ShapeDtypeStruct
TPU_CALL, GPU_CALL = "tpu_custom_call", "__gpu$xla.gpu.triton"
KERNEL_CALL = {"tpu": TPU_CALL, "cuda": GPU_CALL}

# (table, row_scale, ids)
FLAGSHIP = (
    S((1 << 24, 256), jnp.float8_e4m3fn),
    S((1 << 24,), jnp.float32),
    S((4, 2048, 24), jnp.int32),
)
ODD = (S((999_983, 64), jnp.bfloat16), None, S((3, 1001, 7), jnp.int32))
SHAPES = {"fp8_2^24x256_8192x24": FLAGSHIP, "bf16_odd": ODD}


def _lower(fn, args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _custom_calls(text: str) -> set[str]:
    return {c for c in (TPU_CALL, GPU_CALL) if c in text}


@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
@pytest.mark.parametrize("shape", SHAPES)
def test_auto_forward_lowers_to_the_platform_kernel(platform, shape):
    table, scale, ids = SHAPES[shape]
    text = _lower(lambda t, i, s: engram_lookup(t, i, s), (table, ids, scale), platform)
    want = {KERNEL_CALL[platform]} if platform in KERNEL_CALL else set()
    assert _custom_calls(text) == want
    if platform == "cpu":  # nothing of the Pallas branches reaches the CPU program
        assert "custom_call" not in text
    if platform == "tpu":
        assert "cost_estimate" in text and "bytes_accessed" in text
    if platform == "cuda" and table.dtype == jnp.float8_e4m3fn:
        # The FP8 table enters the Triton kernel as uint16 pairs: 2^31 elements, so its
        # 32-bit offsets cannot wrap (2^32 one-byte elements would).
        assert "tensor<16777216x128xui16>" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
@pytest.mark.parametrize("shape", SHAPES)
def test_auto_gradient_lowers(platform, shape):
    """Forward kernel + the scatter-add backward (d_scale for FP8, d_table for bf16)."""
    table, scale, ids = SHAPES[shape]

    def loss_and_grad(t, i, s):
        if s is None:
            return jax.value_and_grad(lambda t: jnp.sum(engram_lookup(t, i)))(t)
        return jax.value_and_grad(lambda s: jnp.sum(engram_lookup(t, i, s)))(s)

    text = _lower(loss_and_grad, (table, ids, scale), platform)
    want = {KERNEL_CALL[platform]} if platform in KERNEL_CALL else set()
    assert _custom_calls(text) == want
    assert "scatter" in text


def test_cpu_touch_gather_only_in_the_cpu_program():
    """A 1 GiB f32 table: the CPU program has the chunked touch gather (a while loop), the
    TPU/CUDA programs of impl="xla" a flat gather only."""
    args = (S((1 << 22, 64), jnp.float32), S((4096, 8), jnp.int32))
    fn = lambda t, i: engram_lookup(t, i, impl="xla")  # noqa: E731
    assert "stablehlo.while" in _lower(fn, args, "cpu")
    for platform in ("tpu", "cuda"):
        text = _lower(fn, args, platform)
        assert "stablehlo.while" not in text and "gather" in text


def test_auto_on_cpu_is_the_xla_program():
    """impl="auto" lowered for CPU is exactly impl="xla" (with the touch gather): the Pallas
    branches of the other platforms leave nothing in it, so it runs as fast as before."""
    args = (S((1 << 22, 64), jnp.float32), S((4096, 8), jnp.int32))

    def lowered(impl):
        fn = jax.jit(lambda t, i: engram_lookup(t, i, impl=impl))
        return fn.trace(*args).lower(lowering_platforms=("cpu",)).as_text(debug_info=False)

    assert lowered("auto") == lowered("xla")


def test_one_program_per_platform_from_one_function():
    """The same jitted function lowers to each platform's kernel: the choice is made at
    lowering, not from jax.default_backend() at trace time."""
    table, scale, ids = FLAGSHIP
    traced = jax.jit(lambda t, i, s: engram_lookup(t, i, s)).trace(table, ids, scale)
    for platform, call in [("tpu", TPU_CALL), ("cuda", GPU_CALL), ("cpu", None)]:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert _custom_calls(text) == ({call} if call else set())


@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_kernels_lower_at_scale(shape):
    table, scale, ids = SHAPES[shape]
    ids2 = S((ids.shape[0] * ids.shape[1], ids.shape[2]), jnp.int32)
    dma = _lower(lambda t, i, s: engram_lookup_dma(t, i, s), (table, ids2, scale), "tpu")
    assert TPU_CALL in dma
    vec = _lower(lambda t, i, s: engram_lookup_vector(t, i, s), (table, ids2, scale), "cuda")
    assert GPU_CALL in vec


def test_big_blocks_get_a_vmem_limit():
    """block_tokens=128 x 24 heads x 256 f32 rows (~19 MiB) is over the default scoped VMEM:
    the TPU call carries an explicit limit."""
    table, scale, ids = S((1 << 20, 256), jnp.float32), S((1 << 20,), jnp.float32), FLAGSHIP[2]
    fn = lambda t, i, s: engram_lookup(t, i, s, impl="pallas_tpu", block_tokens=128)  # noqa: E731
    assert "scoped_memory_configs" in _lower(fn, (table, ids, scale), "tpu")
    assert "scoped_memory_configs" not in _lower(
        lambda t, i, s: engram_lookup(t, i, s), (table, ids, scale), "tpu"
    )


def _trace(fn, args):
    return jax.jit(fn).trace(*args)


@pytest.mark.parametrize(
    "table,kwargs,match",
    [
        (S((1 << 20, 96), jnp.float32), {"impl": "pallas_gpu"}, r"power-of-two E.*E=96"),
        (
            S((1 << 20, 256), jnp.float32),
            {"impl": "pallas_gpu", "block_tokens": 8192},
            r"\(8192, 256\).*1048576 elements",
        ),
        (
            S((1 << 20, 256), jnp.float32),
            {"impl": "pallas_tpu", "block_tokens": 1024},
            r"24576 rows of E=256 need \d+ MiB of VMEM, over its 48 MiB limit",
        ),
        (
            S((1 << 20, 256), jnp.float32),
            {"impl": "pallas_tpu", "block_tokens": 3},
            r"multiple of 8.*block_tokens=3, H=7",
        ),
    ],
)
def test_shape_a_kernel_cannot_take_raises_before_lowering(table, kwargs, match):
    ids = S((8192, 7 if kwargs.get("block_tokens") == 3 else 24), jnp.int32)
    with pytest.raises(ValueError, match=match):
        _trace(lambda t, i: engram_lookup(t, i, **kwargs), (table, ids))  # at trace time


def test_pallas_choice_a_platform_cannot_compile_raises_when_lowered_for_it():
    table, ids = S((1 << 20, 96), jnp.float32), S((8192, 24), jnp.int32)
    traced = _trace(lambda t, i: engram_lookup(t, i, impl="pallas"), (table, ids))
    assert TPU_CALL in traced.lower(lowering_platforms=("tpu",)).as_text()
    with pytest.raises(ValueError, match=r"lowered for 'cuda'.*power-of-two E.*E=96"):
        traced.lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="no compiled kernel for 'cpu'.*interpret=True"):
        traced.lower(lowering_platforms=("cpu",))
    tpu_only = _trace(lambda t, i: engram_lookup(t, i, impl="pallas_tpu"), (table, ids))
    with pytest.raises(ValueError, match="compiles only for TPU.*lowered for 'cuda'"):
        tpu_only.lower(lowering_platforms=("cuda",))
    # "auto" never errors: the GPU branch of this shape is the XLA gather.
    auto = _trace(lambda t, i: engram_lookup(t, i), (table, ids))
    assert _custom_calls(auto.lower(lowering_platforms=("cuda",)).as_text()) == set()


def test_tpu_kernel_refuses_a_64_bit_table_by_name():
    """The TPU kernel DMAs 8/16/32-bit rows only (``rows_per_dma``): pallas_tpu refuses a
    float64 table at trace time, naming the dtype; "auto" takes the XLA gather on TPU."""
    table, ids = S((64, 128), jnp.float64), S((8, 3), jnp.int32)
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="8, 16 or 32-bit tables, got float64"):
            _trace(lambda t, i: engram_lookup(t, i, impl="pallas_tpu"), (table, ids))
        auto = _trace(lambda t, i: engram_lookup(t, i), (table, ids))
        assert _custom_calls(auto.lower(lowering_platforms=("tpu",)).as_text()) == set()
