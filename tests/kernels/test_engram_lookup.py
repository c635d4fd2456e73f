"""Engram lookup: every impl (XLA, Pallas interpreted, reference) agrees, values and grads.

Sizes are deliberately odd (R=1009 rows, E=17/24, H=3/6, N=37 or [2, 19] tokens) so no
dimension is a multiple of a block; Pallas runs interpreted on CPU (cost grows with grid
steps, so token counts stay small). Compiled-kernel twins run only on their backend.
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
from v41jax.kernels.engram_lookup.kernel import engram_lookup_dma, engram_lookup_vector

ROWS = 1009
# (E, H, leading dims of ids)
SHAPES = [(24, 3, (37,)), (17, 6, (2, 19))]
# (impl, interpret): on CPU "pallas" resolves to the TPU DMA kernel, interpreted.
IMPLS = [("xla", False), ("reference", False), ("pallas", True), ("pallas_gpu", True)]


def _inputs(emb, heads, lead, seed=0, max_id=ROWS):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal((ROWS, emb), dtype=np.float32))
    ids = jnp.asarray(rng.integers(0, max_id, size=(*lead, heads)), jnp.int32)
    scale = jnp.asarray(rng.uniform(0.01, 3.0, ROWS).astype(np.float32))
    return table, ids, scale


def _fp8(table):
    return (table * 50.0).astype(jnp.float8_e4m3fn)


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("emb,heads,lead", SHAPES)
def test_fp32_matches_reference_exactly(impl, interpret, emb, heads, lead):
    table, ids, _ = _inputs(emb, heads, lead)
    out = engram_lookup(table, ids, impl=impl, interpret=interpret)
    assert out.shape == (*lead, heads * emb) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, engram_lookup_reference(table, ids))
    # The concatenation order: head h occupies columns [h*E, (h+1)*E).
    np.testing.assert_array_equal(out[..., emb : 2 * emb], table[ids[..., 1]])


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("emb,heads,lead", SHAPES)
def test_fp8_dequant_matches_reference_exactly(impl, interpret, emb, heads, lead):
    table, ids, scale = _inputs(emb, heads, lead, seed=1)
    q = _fp8(table)
    out = engram_lookup(q, ids, scale, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(out, engram_lookup_reference(q, ids, scale))
    expect = q[ids].astype(jnp.float32) * scale[ids][..., None]
    np.testing.assert_array_equal(out, expect.reshape(*lead, heads * emb))


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_bf16_out_and_table(impl, interpret):
    table, ids, scale = _inputs(24, 3, (37,), seed=2)
    table = table.astype(jnp.bfloat16)
    for s in (None, scale):
        out = engram_lookup(table, ids, s, impl=impl, interpret=interpret, out_dtype=jnp.bfloat16)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(out, engram_lookup_reference(table, ids, s, jnp.bfloat16))


def _loss(lookup, table, ids, scale, weights):
    return jnp.sum(weights * jnp.sin(lookup(table, ids, scale)))


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("with_scale", [False, True])
def test_grads_match_reference_with_duplicates(impl, interpret, with_scale):
    emb, heads, lead = 17, 3, (2, 19)
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


@pytest.mark.parametrize("impl,interpret", [("xla", False), ("pallas", True)])
def test_under_jit(impl, interpret):
    table, ids, scale = _inputs(24, 6, (2, 19), seed=6)
    fn = jax.jit(lambda t, i, s: engram_lookup(t, i, s, impl=impl, interpret=interpret))
    np.testing.assert_array_equal(fn(table, ids, scale), engram_lookup_reference(table, ids, scale))


def test_dma_kernel_odd_blocks_and_chunked_calls():
    table, ids, scale = _inputs(17, 3, (37,), seed=7)
    want = engram_lookup_reference(table, ids, scale)
    # 5 tokens per step (37 = 7*5 + a tail of 2), the ids split over two pallas_calls.
    out = engram_lookup_dma(table, ids, scale, block_tokens=5, interpret=True, max_ids_per_call=60)
    np.testing.assert_array_equal(out, want)
    out = engram_lookup_vector(table, ids, scale, block_tokens=16, interpret=True)
    np.testing.assert_array_equal(out, want)


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


def test_impl_dispatch(monkeypatch):
    table24, _, _ = _inputs(24, 3, (1,))
    table32 = jnp.zeros((ROWS, 32))
    resolve = lookup_api._resolve_impl
    assert resolve("auto", False, table24, None, 3) == "xla"  # CPU: XLA gather
    with pytest.raises(ValueError, match="interpret=True"):
        engram_lookup(table24, jnp.zeros((4, 3), jnp.int32), impl="pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve("auto", False, table32, None, 3) == "pallas_gpu"
    assert resolve("auto", False, table24, None, 3) == "xla"  # Triton needs power-of-two E
    with pytest.raises(ValueError, match="power-of-two E.*E=24"):
        resolve("pallas", False, table24, None, 3)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve("auto", False, table24, None, 3) == "pallas_tpu"
    with pytest.raises(ValueError, match="multiple of 8.*block_tokens=3, H=3"):
        resolve("pallas", False, table24, 3, 3)


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


@pytest.mark.parametrize(
    "backend,impl,emb",
    [("tpu", "pallas_tpu", 24), ("gpu", "pallas_gpu", 32)],
)
def test_compiled_kernel_matches_reference(backend, impl, emb):
    """The compiled twin of the interpreted tests; runs only on its own backend."""
    if jax.default_backend() != backend:
        pytest.skip(f"compiled {impl} needs a {backend.upper()}")
    table, ids, scale = _inputs(emb, 3, (37,), seed=9)
    for t, s in ((table, None), (_fp8(table), scale)):
        out = engram_lookup(t, ids, s, impl=impl)
        np.testing.assert_array_equal(out, engram_lookup_reference(t, ids, s))
