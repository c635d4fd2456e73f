"""The native host-table gather (XLA FFI on CPU) equals `HostTable.gather` bit for bit in
every storage format, at odd sizes, under jit and vmap; bad ids fail naming the id; layouts
it cannot read fall back to the callback (`HostRows.native` is None)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from v41jax.engram.fp8 import quantize_blocks_np
from v41jax.engram.host_rows import HostRows
from v41jax.engram.host_table import HostTable
from v41jax.engram.table_file import create_table_file, quantize_rows_np
from v41jax.kernels import host_gather

R, C = 1009, 24
pytestmark = pytest.mark.skipif(not host_gather.available(), reason="no C++ compiler")


def table_in(fmt, seed=0):
    x = np.random.default_rng(seed).standard_normal((R, C)).astype(np.float32)
    x[5] = 0.0  # an all-zero row (scale 1 / exponent edge)
    if fmt == "float32":
        return HostTable(x)
    if fmt == "bfloat16":
        return HostTable(x.astype(ml_dtypes.bfloat16))
    if fmt == "fp8_row_scale":
        return HostTable(*quantize_rows_np(x))
    return HostTable(*quantize_blocks_np(x, 8))


def native_of(t):
    return host_gather.NativeTable.from_arrays(t.table, t.block_exp if t.block_exp is not None
                                               else t.scale)  # fmt: skip


@pytest.mark.parametrize("fmt", list(host_gather.KINDS))
def test_native_gather_equals_the_host_gather_bitwise(fmt):
    t = table_in(fmt)
    native = native_of(t)
    assert native is not None and native.kind == host_gather.KINDS[fmt]
    ids = np.random.default_rng(1).integers(0, R, (3, 5, 7)).astype(np.int32)
    ids[0, 0, :2] = [0, R - 1]
    want = t.gather(ids.reshape(-1, 1)).reshape(3, 5, 7, C)
    got = jax.jit(lambda i: host_gather.gather(native, i))(ids)
    assert got.shape == (3, 5, 7, C) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    batched = jax.vmap(lambda i: host_gather.gather(native, i))(jnp.asarray(ids))
    np.testing.assert_array_equal(batched, want)


def test_an_id_outside_the_table_fails_naming_it():
    native = native_of(table_in("float32"))
    with pytest.raises(Exception, match=r"row id 1009 outside \[0, 1009\)"):
        jax.block_until_ready(jax.jit(lambda i: host_gather.gather(native, i))(jnp.array([3, R])))
    with pytest.raises(TypeError, match="ids must be integers"):
        host_gather.gather(native, jnp.zeros(3))


def test_layouts_it_cannot_read_are_left_to_the_callback(tmp_path):
    x = np.zeros((R, C), np.float32)
    assert host_gather.NativeTable.from_arrays(x.astype(np.float16)) is None
    assert host_gather.NativeTable.from_arrays(np.asfortranarray(x)) is None
    assert host_gather.NativeTable.from_arrays(x[:, ::2]) is None
    q, s = quantize_rows_np(x)
    assert host_gather.NativeTable.from_arrays(q, s[:-1]) is None  # wrong scale shape
    assert host_gather.NativeTable.from_arrays(q) is None  # fp8 needs a scale
    # a lazy file with rows never written: their values are computed on the host
    tf = create_table_file(str(tmp_path / "t"), R, C, progress=False)
    tf.update_rows(np.arange(R - 1), x[: R - 1])
    assert HostRows(tf).native() is None
    tf.update_rows(np.array([R - 1]), x[-1:])
    rows = HostRows(tf)
    assert rows.native() is not None
    ids = jnp.arange(R, dtype=jnp.int32).reshape(1, -1, 1)
    np.testing.assert_array_equal(jax.jit(rows.lookup)(ids)[0], tf.gather(np.arange(R)))


def test_the_mode_switch(monkeypatch):
    monkeypatch.setenv("V41JAX_HOST_GATHER", "callback")
    assert not host_gather.available() and HostRows(np.zeros((4, 2), np.float32)).native() is None
    monkeypatch.setenv("V41JAX_HOST_GATHER", "fastest")
    with pytest.raises(ValueError, match="V41JAX_HOST_GATHER='fastest' must be one of"):
        host_gather.available()
