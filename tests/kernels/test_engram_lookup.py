"""Engram lookup: every impl (XLA, Pallas, reference) agrees, values and grads.

Sizes are deliberately odd (R=1009 rows, E=17/24/32, H=3/6, N=37 or [2, 19] tokens) so
no token count is a multiple of a block. Pallas tests take the ``interpret`` fixture
(tests/conftest.py): interpreted here (cost grows with grid steps, so token counts stay
small), compiled twins on a GPU/TPU (``scripts/device_check.sh``, ``-k compiled``), where
each kernel runs only on its own platform and the Triton one only with power-of-two E.
Lowering for TPU/GPU at full scale: test_lowering_engram_lookup.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from v41jax.kernels.engram_lookup import api as lookup_api
from v41jax.kernels.engram_lookup import (
    check_ids,
    engram_lookup,
    engram_lookup_reference,
)
from v41jax.kernels.engram_lookup.kernel import (
    decode_e4m3,
    engram_lookup_dma,
    engram_lookup_vector,
)

ROWS = 1009
# (E, H, leading dims of ids)
SHAPES = [(24, 3, (37,)), (17, 6, (2, 19)), (32, 3, (37,))]
# The power-of-two E (the only one the compiled Triton kernel takes) is slow when
# interpreted: the two odd ones stay fast; its compiled twin stays fast (tests/conftest.py).
SHAPE_PARAMS = [pytest.param(*s, marks=pytest.mark.slow if s[0] == 32 else ()) for s in SHAPES]
XLA_IMPLS = ["xla", "reference"]
KERNELS = ["pallas_tpu", "pallas_gpu"]
NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def _impls(interpret, emb):
    """(impl, interpret) pairs of one test that run here: the XLA impls once (with the
    interpreted twin), each Pallas kernel in the fixture's mode where it runs (``_runs``);
    skips the test when none does."""
    pairs = [(i, False) for i in XLA_IMPLS if interpret] + [(k, interpret) for k in KERNELS]
    pairs = [(i, interp) for i, interp in pairs if _runs(i, interp, emb)]
    if not pairs:
        pytest.skip(f"no compiled kernel takes E={emb} on {jax.default_backend()}")
    return pairs


def _runs(impl, interpret, emb) -> bool:
    """Whether ``impl`` runs here: interpreted always; compiled only on its own platform,
    Triton only with power-of-two E."""
    if interpret or impl in XLA_IMPLS:
        return True
    if NATIVE.get(jax.default_backend()) != impl:
        return False
    return impl != "pallas_gpu" or not emb & (emb - 1)


def _inputs(emb, heads, lead, seed=0, max_id=ROWS):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal((ROWS, emb), dtype=np.float32))
    ids = jnp.asarray(rng.integers(0, max_id, size=(*lead, heads)), jnp.int32)
    scale = jnp.asarray(rng.uniform(0.01, 3.0, ROWS).astype(np.float32))
    return table, ids, scale


def _fp8(table):
    return (table * 50.0).astype(jnp.float8_e4m3fn)


@pytest.mark.parametrize("emb,heads,lead", SHAPE_PARAMS)
def test_fp32_matches_reference_exactly(interpret, emb, heads, lead):
    table, ids, _ = _inputs(emb, heads, lead)
    want = engram_lookup_reference(table, ids)
    for impl, interp in _impls(interpret, emb):
        out = engram_lookup(table, ids, impl=impl, interpret=interp)
        assert out.shape == (*lead, heads * emb) and out.dtype == jnp.float32
        np.testing.assert_array_equal(out, want, err_msg=impl)
    # The concatenation order: head h occupies columns [h*E, (h+1)*E).
    np.testing.assert_array_equal(want[..., emb : 2 * emb], table[ids[..., 1]])


@pytest.mark.parametrize("emb,heads,lead", SHAPE_PARAMS)
def test_fp8_dequant_matches_reference_exactly(interpret, emb, heads, lead):
    table, ids, scale = _inputs(emb, heads, lead, seed=1)
    q = _fp8(table)
    expect = q[ids].astype(jnp.float32) * scale[ids][..., None]
    np.testing.assert_array_equal(
        engram_lookup_reference(q, ids, scale), expect.reshape(*lead, heads * emb)
    )
    for impl, interp in _impls(interpret, emb):
        out = engram_lookup(q, ids, scale, impl=impl, interpret=interp)
        np.testing.assert_array_equal(out, expect.reshape(out.shape), err_msg=impl)


def test_fp8_decode_is_exact_for_every_byte():
    """The GPU kernel's in-kernel FP8 decode (uint16 pairs) equals XLA's conversion for all
    256 bit patterns, NaNs, signed zeros and subnormals included."""
    bits = np.arange(256, dtype=np.uint8)
    want = jnp.asarray(bits.view(jnp.float8_e4m3fn)).astype(jnp.float32)
    got = decode_e4m3(jnp.asarray(bits, jnp.uint32))
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(got, want)
    table = jnp.asarray(np.stack([bits, bits[::-1]]).view(jnp.float8_e4m3fn))  # [2, 256]
    ids = jnp.asarray([[1, 0], [0, 0], [1, 1]], jnp.int32)
    out = engram_lookup_vector(table, ids, block_tokens=2, interpret=True)
    np.testing.assert_array_equal(out, engram_lookup_reference(table, ids))


def test_bf16_out_and_table(interpret):
    table, ids, scale = _inputs(32, 3, (37,), seed=2)
    table = table.astype(jnp.bfloat16)
    for impl, interp in _impls(interpret, 32):
        for s in (None, scale):
            out = engram_lookup(table, ids, s, impl=impl, interpret=interp, out_dtype=jnp.bfloat16)
            assert out.dtype == jnp.bfloat16
            want = engram_lookup_reference(table, ids, s, jnp.bfloat16)
            np.testing.assert_array_equal(out, want, err_msg=impl)


def _loss(lookup, table, ids, scale, weights):
    return jnp.sum(weights * jnp.sin(lookup(table, ids, scale)))


@pytest.mark.parametrize("impl", XLA_IMPLS + KERNELS)
@pytest.mark.parametrize("with_scale", [False, True])
def test_grads_match_reference_with_duplicates(interpret, impl, with_scale):
    emb, heads, lead = 16, 3, (2, 19)
    if impl in XLA_IMPLS and not interpret:
        pytest.skip("XLA impls: one run (the interpreted twin)")
    if not _runs(impl, interpret, emb):
        pytest.skip(f"compiled {impl} does not run on {jax.default_backend()}")
    # Ids from 40 rows only: most rows are hit many times, so duplicates must accumulate.
    table, ids, scale = _inputs(emb, heads, lead, seed=3, max_id=40)
    scale = scale if with_scale else None
    weights = jnp.asarray(np.random.default_rng(4).standard_normal((*lead, heads * emb)))

    def ours(t, i, s):
        return engram_lookup(t, i, s, impl=impl, interpret=interpret)

    argnums = (0, 2) if with_scale else (0,)
    got = jax.grad(_loss, argnums=(1, 3)[: len(argnums)])(ours, table, ids, scale, weights)
    want = jax.grad(_loss, argnums=(1, 3)[: len(argnums)])(
        engram_lookup_reference, table, ids, scale, weights
    )
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # Rows never looked up get exactly zero gradient.
    assert not np.any(np.asarray(got[0])[40:])


def test_fp8_table_gets_zero_grad_scale_gets_its_grad():
    table, ids, scale = _inputs(24, 3, (37,), seed=5)
    q = _fp8(table)
    weights = jnp.ones((37, 72))
    d_q, d_s = jax.grad(_loss, argnums=(1, 3))(engram_lookup, q, ids, scale, weights)
    assert d_q.dtype == q.dtype and not np.any(np.asarray(d_q.astype(jnp.float32)))
    want = jax.grad(_loss, argnums=3)(engram_lookup_reference, q, ids, scale, weights)
    np.testing.assert_allclose(d_s, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "xla", "pallas"])
def test_under_jit(interpret, impl):
    """One jitted program; "auto" and "pallas" pick the kernel of the platform it runs on."""
    table, ids, scale = _inputs(32, 6, (2, 19), seed=6)
    if impl != "pallas" and not interpret:
        pytest.skip("XLA impls: one run (the interpreted twin)")
    fn = jax.jit(lambda t, i, s: engram_lookup(t, i, s, impl=impl, interpret=interpret))
    np.testing.assert_array_equal(fn(table, ids, scale), engram_lookup_reference(table, ids, scale))


def test_dma_kernel_odd_blocks_and_chunked_calls(interpret):
    if not _runs("pallas_tpu", interpret, 17):
        pytest.skip("compiled DMA kernel: TPU only")
    table, ids, scale = _inputs(17, 3, (37,), seed=7)
    want = engram_lookup_reference(table, ids, scale)
    # 8 tokens per step (37 = 4*8 + a tail of 5), the ids split over two pallas_calls.
    out = engram_lookup_dma(
        table, ids, scale, block_tokens=8, interpret=interpret, max_ids_per_call=60
    )
    np.testing.assert_array_equal(out, want)


def test_vector_kernel_odd_blocks(interpret):
    if not _runs("pallas_gpu", interpret, 16):
        pytest.skip("compiled vector kernel: GPU only")
    table, ids, scale = _inputs(16, 3, (37,), seed=7)
    for t in (table, _fp8(table)):
        out = engram_lookup_vector(t, ids, scale, block_tokens=16, interpret=interpret)
        np.testing.assert_array_equal(out, engram_lookup_reference(t, ids, scale))


def test_cpu_touch_gather_path(monkeypatch):
    """The chunked touch-then-gather XLA path (big f32 tables on CPU) is exact, incl. a
    ragged last chunk, and keeps the custom gradient."""
    table, ids, scale = _inputs(17, 3, (37,), seed=10)
    rows = lookup_api._gather_rows_touched(table, ids.reshape(-1), 16)  # 111 = 6*16 + 15
    np.testing.assert_array_equal(rows, table[ids.reshape(-1)])
    monkeypatch.setattr(lookup_api, "TOUCH_CHUNK_ROWS", 16)
    monkeypatch.setattr(lookup_api, "TOUCH_MIN_TABLE_BYTES", 0)
    assert lookup_api._touch_chunk(table, ids.size) == 16
    assert lookup_api._touch_chunk(table.astype(jnp.bfloat16), ids.size) == 0
    for s in (None, scale):
        out = engram_lookup(table, ids, s, impl="xla")
        np.testing.assert_array_equal(out, engram_lookup_reference(table, ids, s))
    weights = jnp.ones((37, 51))
    got = jax.grad(_loss, argnums=1)(engram_lookup, table, ids, None, weights)
    want = jax.grad(_loss, argnums=1)(engram_lookup_reference, table, ids, None, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_dma_kernel_semaphores_balance_in_tpu_interpreter():
    """The TPU interpreter simulates DMAs and semaphores: it fails on a semaphore left
    non-zero at kernel end and flags races between the prefetch and the reads."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    table, ids, scale = _inputs(17, 3, (37,), seed=8)
    params = pltpu.InterpretParams(detect_races=True)
    out = engram_lookup_dma(_fp8(table), ids, scale, block_tokens=4, interpret=params)
    np.testing.assert_array_equal(out, engram_lookup_reference(_fp8(table), ids, scale))
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


def test_empty_ids():
    table, _, _ = _inputs(24, 3, (1,))
    out = engram_lookup(table, jnp.zeros((0, 3), jnp.int32))
    assert out.shape == (0, 72)


def test_impl_choice_per_platform():
    """The static choice of each platform's branch (which one runs is decided at lowering,
    see test_lowering_engram_lookup.py); the touch gather is CPU only."""
    table24, _, _ = _inputs(24, 3, (1,))
    table32 = jnp.zeros((ROWS, 32))
    big = jax.ShapeDtypeStruct((1 << 20, 32), jnp.float32)  # 128 MiB: touch-gather size
    choose = lambda impl, t, bt=None, interp=False: {  # noqa: E731
        p: c.impl for p, c in lookup_api._choose(impl, interp, t, bt, 3, 3 << 13, True).items()
    }
    assert choose("auto", table32) == {"cpu": "xla", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}
    # Triton needs power-of-two E: "auto" falls back to XLA there, "pallas" errors there.
    assert choose("auto", table24) == {"cpu": "xla", "cuda": "xla", "tpu": "pallas_tpu"}
    assert choose("pallas", table24) == {"cpu": "error", "cuda": "error", "tpu": "pallas_tpu"}
    assert choose("pallas", table24, interp=True) == {
        "cpu": "pallas_tpu",
        "cuda": "pallas_gpu",
        "tpu": "pallas_tpu",
    }
    touch = {
        p: c.touch_chunk
        for p, c in lookup_api._choose("auto", False, big, None, 3, 3 << 13, False).items()
    }
    assert touch == {"cpu": lookup_api.TOUCH_CHUNK_ROWS, "cuda": 0, "tpu": 0}
    with pytest.raises(ValueError, match="power-of-two E.*E=24"):
        engram_lookup(table24, jnp.zeros((4, 3), jnp.int32), impl="pallas_gpu")
    with pytest.raises(ValueError, match="multiple of 8.*block_tokens=3, H=3"):
        engram_lookup(table24, jnp.zeros((4, 3), jnp.int32), impl="pallas_tpu", block_tokens=3)
    # Compiled Pallas lowered for CPU: a clear error when it is lowered (here: run eagerly).
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="no compiled kernel for 'cpu'.*interpret=True"):
            engram_lookup(table24, jnp.zeros((4, 3), jnp.int32), impl="pallas")


@pytest.mark.parametrize(
    "table,ids,scale,kwargs,match",
    [
        (jnp.zeros((5,)), jnp.zeros((2, 3), jnp.int32), None, {}, r"2-D \[R, E\].*\(5,\)"),
        (jnp.zeros((5, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32), None, {}, "int32"),
        (jnp.zeros((5, 4)), jnp.zeros((2, 3)), None, {}, "integer.*float32"),
        (jnp.zeros((5, 4)), jnp.zeros((), jnp.int32), None, {}, r"\[\.\.\., H\]"),
        (jnp.zeros((5, 4)), jnp.zeros((2, 3), jnp.int32), jnp.ones(4), {}, r"\(5,\).*\(4,\)"),
        (
            jnp.zeros((5, 4)),
            jnp.zeros((2, 3), jnp.int32),
            jnp.ones(5, jnp.bfloat16),
            {},
            "float32, got bfloat16",
        ),
        (jnp.zeros((5, 4)), jnp.zeros((2, 3), jnp.int32), None, {"impl": "cuda"}, "'cuda'"),
        (jnp.zeros((5, 4)), jnp.zeros((2, 3), jnp.int32), None, {"block_tokens": 0}, "got 0"),
        (
            jnp.zeros((5, 4)),
            jnp.zeros((2, 3), jnp.int32),
            None,
            {"out_dtype": jnp.int32},
            "out_dtype.*int32",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(table, ids, scale, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engram_lookup(table, ids, scale, **kwargs)


def test_check_ids():
    check_ids(np.array([[0, 4], [2, 3]]), 5)
    with pytest.raises(ValueError, match=r"id 5 at index \(1, 0\) is outside \[0, 5\)"):
        check_ids(np.array([[0, 4], [5, -1]]), 5)
    with pytest.raises(ValueError, match="id -1"):
        check_ids(jnp.array([-1]), 5)


@pytest.mark.parametrize("rows", [1009, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_dma_kernel_row_groups_and_table_tail(dtype, rows):
    """The TPU kernel DMAs the aligned group of 16 (bf16) / 32 (fp8) rows around each id and
    picks the row in VMEM; ids in the last partial group (1009 = 31*32 + 17) come from the
    table's tail block, a table under one group is padded. Bit-exact, signed zeros and NaN
    included; with and without scales."""
    group = {4: 1, 2: 16, 1: 32}[jnp.dtype(dtype).itemsize]
    edge = {0, group - 1, group, rows - rows % group - 1, rows - rows % group, rows - 1}
    edge = sorted(i for i in edge if 0 <= i < rows)
    table, _, scale = _inputs(24, 3, (1,), seed=11)
    table = table[:rows].at[0, :3].set(jnp.array([-0.0, jnp.nan, 0.0])).astype(dtype)
    ids = jnp.asarray(np.resize(edge, (9, 3)), jnp.int32)
    for s in (None, scale[:rows]):
        got = engram_lookup_dma(table, ids, s, block_tokens=8, interpret=True)
        want = engram_lookup_reference(table, ids, s)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
        )
