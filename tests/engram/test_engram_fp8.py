"""FP8 Engram tables: per-row e4m3 quantisation, its error bound, and that fake-quantised
training rows equal exported-then-gathered inference rows bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.engram.config import TABLE_DTYPES
from v41jax.engram.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    convert_table,
    dequantize_rows,
    export_fp8,
    fake_quantize_rows,
    fp8_error_bound,
    fp8_relative_error_bound,
    import_fp8,
    quantize_rows,
)
from v41jax.kernels.engram_lookup import engram_lookup

ROWS, EMB, HEADS = 1009, 24, 3


def _wide_range_table(seed=0, rows=ROWS, emb=EMB):
    """Rows of mixed character: gaussian, log-uniform magnitudes over 12 decades (so many
    elements are FP8-subnormal or flush to zero), one huge outlier, and an all-zero row."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((rows, emb)).astype(np.float32)
    third = rows // 3
    mags = 10.0 ** rng.uniform(-8, 4, size=(third, emb))
    t[third : 2 * third] = (mags * rng.choice([-1, 1], size=mags.shape)).astype(np.float32)
    t[2 * third :, 0] *= 1e5  # outlier dominates its row's scale
    t[7] = 0.0
    return jnp.asarray(t)


def test_quantize_rows_format():
    table = _wide_range_table()
    q, scale = quantize_rows(table)
    assert q.shape == table.shape and q.dtype == FP8_DTYPE
    assert scale.shape == (ROWS,) and scale.dtype == jnp.float32
    # The largest element of each row maps to +-448 (the e4m3fn max), up to f32 rounding.
    q_max = np.abs(np.asarray(q.astype(jnp.float32))).max(axis=1)
    np.testing.assert_array_equal(np.delete(q_max, 7), FP8_MAX)
    # An all-zero row: scale 1, exact zeros back.
    assert scale[7] == 1.0 and not np.any(np.asarray(dequantize_rows(q, scale))[7])
    assert not np.any(np.isnan(np.asarray(q.astype(jnp.float32))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_error_within_bound(seed):
    table = _wide_range_table(seed)
    q, scale = quantize_rows(table)
    err = np.abs(np.asarray(dequantize_rows(q, scale) - table))
    bound = np.asarray(fp8_error_bound(table, scale))
    assert np.all(err <= bound), f"worst err/bound {np.max(err / bound)}"
    # The bound is tight: round-to-nearest reaches (almost) half a spacing somewhere.
    assert np.max(err / bound) > 0.9
    # Relative bound 2^-4 for every element in the e4m3 normal range (|x| >= 2^-6 s).
    x = np.abs(np.asarray(table))
    normal = x >= 2.0**-6 * np.asarray(scale)[:, None]
    rel = err[normal] / x[normal]
    assert fp8_relative_error_bound() == 2.0**-4
    assert np.all(rel <= fp8_relative_error_bound() * (1 + 2.0**-18))
    assert rel.max() > 0.9 * fp8_relative_error_bound()


def test_every_fp8_value_round_trips_exactly():
    """A row holding all 253 finite non-negative e4m3fn values (times a power of two
    scale) is representable, so it must come back unchanged."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn.dtype)
    values = codes.astype(np.float32)
    values = np.unique(np.abs(values[np.isfinite(values)]))
    row = jnp.asarray(values * 2.0**-5, jnp.float32)[None, :]
    q, scale = quantize_rows(row)
    np.testing.assert_array_equal(dequantize_rows(q, scale), row)


def test_fake_quantize_equals_export_then_gather():
    """Per-row quantisation commutes with gathering: training (gather the master, then
    fake-quantise the gathered rows) sees exactly the exported inference table's rows."""
    master = _wide_range_table(3)
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, ROWS, size=(2, 19, HEADS)), jnp.int32)
    stored = export_fp8(master)
    want = engram_lookup(stored["q"], ids, stored["scale"])

    def train_rows(m, i):
        rows = engram_lookup(m, i).reshape(*i.shape, EMB)
        return fake_quantize_rows(rows).reshape(*i.shape[:-1], HEADS * EMB)

    np.testing.assert_array_equal(train_rows(master, ids), want)
    np.testing.assert_array_equal(jax.jit(train_rows)(master, ids), want)
    np.testing.assert_array_equal(fake_quantize_rows(master), import_fp8(stored))


def test_fake_quantize_straight_through_gradient():
    master = _wide_range_table(5)
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 50, size=(37, HEADS)), jnp.int32)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((37, HEADS * EMB)), jnp.float32)

    def loss(m, fake_quant):
        rows = engram_lookup(m, ids).reshape(37, HEADS, EMB)
        rows = fake_quantize_rows(rows) if fake_quant else rows
        return jnp.sum(w * rows.reshape(37, HEADS * EMB))

    np.testing.assert_array_equal(jax.grad(loss)(master, True), jax.grad(loss)(master, False))
    g = jax.grad(lambda x: jnp.sum(fake_quantize_rows(x) * 3.0))(master.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16 and np.all(np.asarray(g, np.float32) == 3.0)


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
def test_convert_table_feeds_lookup(table_dtype):
    master = _wide_range_table(8)
    ids = jnp.asarray(np.random.default_rng(9).integers(0, ROWS, size=(37, HEADS)), jnp.int32)
    table, scale = convert_table(master, table_dtype)
    assert table.dtype == jnp.dtype(table_dtype) and (scale is None) == (
        table_dtype != "float8_e4m3fn"
    )
    got = np.asarray(engram_lookup(table, ids, scale)).reshape(37, HEADS, EMB)
    x = np.asarray(master)[np.asarray(ids)]
    if table_dtype == "float8_e4m3fn":
        bound = np.asarray(fp8_error_bound(x, scale[ids]))
    else:
        bound = np.abs(x) * float(jnp.finfo(table_dtype).eps)
    assert np.all(np.abs(got - x) <= bound)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="table_dtype.*'int8'"):
        convert_table(jnp.zeros((3, 4)), "int8")
    with pytest.raises(ValueError, match=r"2-D.*\(4,\)"):
        quantize_rows(jnp.zeros((4,)))
    with pytest.raises(ValueError, match=r"scale shape \(4,\).*\(3,\)"):
        dequantize_rows(jnp.zeros((3, 4), FP8_DTYPE), jnp.ones(4))
