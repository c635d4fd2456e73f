import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.engram import fp8
from v41jax.engram.host_table import FP8_NUMPY, HostTable
from v41jax.kernels.engram_lookup.reference import engram_lookup_reference


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_host_gather_equals_reference(threads):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1009, 17)).astype(np.float32)
    ids = rng.integers(0, 1009, (3, 2000, 5))  # large enough to split over threads
    ids[0, 0] = [0, 1008, 1008, 7, 0]  # first, last and duplicate rows
    got = HostTable(table, threads=threads).gather(ids)
    want = engram_lookup_reference(jnp.asarray(table), jnp.asarray(ids))
    np.testing.assert_array_equal(got, np.asarray(want))
    assert got.shape == (3, 2000, 5 * 17) and got.dtype == np.float32


def test_host_gather_fp8_rows_dequantise_like_the_device():
    rng = np.random.default_rng(1)
    q, scale = fp8.quantize_rows(jnp.asarray(rng.standard_normal((101, 8)), jnp.float32))
    ids = rng.integers(0, 101, (64, 3))
    got = HostTable(np.asarray(q).view(FP8_NUMPY), np.asarray(scale), threads=2).gather(ids)
    want = engram_lookup_reference(q, jnp.asarray(ids), scale)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-7)


def test_host_gather_errors_name_the_value():
    table = HostTable(np.zeros((10, 4), np.float32), threads=1)
    with pytest.raises(ValueError, match="id 10 outside"):
        table.gather(np.array([[1, 10]]))
    with pytest.raises(ValueError, match="id -1 outside"):
        table.gather(np.array([[-1, 3]]))
    with pytest.raises(TypeError, match="integers"):
        table.gather(np.array([[1.0]]))
    with pytest.raises(ValueError, match="needs a row scale"):
        HostTable(np.zeros((10, 4), FP8_NUMPY))
    with pytest.raises(ValueError, match=r"must be \[R, E\]"):
        HostTable(np.zeros(10, np.float32))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_host_gather_fp8_blocks_equals_dequantize_blocks(threads):
    """V4.1's block format (fp8 + UE8M0 exponent per 32 values): the host gather gives the
    rows of fp8.dequantize_blocks bit for bit, split over threads or not."""
    rng = np.random.default_rng(2)
    master = rng.standard_normal((1009, 96)) * 10.0 ** rng.uniform(-6, 6, (1009, 3)).repeat(32, 1)
    master[5, 32:64] = 0.0  # a zero block
    stored = fp8.export_fp8_blocks(master.astype(np.float32))
    ids = rng.integers(0, 1009, (3, 2000, 5))  # large enough to split over threads
    ids[0, 0] = [0, 1008, 1008, 5, 0]
    host = HostTable(stored["q"], stored["scale_exp"], threads=threads)
    got = host.gather(ids)
    q, exp = jnp.asarray(stored["q"]), jnp.asarray(stored["scale_exp"])
    want = np.asarray(fp8.dequantize_blocks(q, exp))[ids].reshape(3, 2000, 5 * 96)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(host.gather(ids[:0]), want[:0])
    host.close()


def test_host_table_block_exponent_errors():
    q = np.zeros((10, 64), FP8_NUMPY)
    with pytest.raises(ValueError, match=r"block exponents shape \(10, 3\).*E=64"):
        HostTable(q, np.full((10, 3), 127, np.uint8))
    with pytest.raises(ValueError, match=r"block exponents shape \(9, 2\)"):
        HostTable(q, np.full((9, 2), 127, np.uint8))
    exp = np.full((10, 2), 127, np.uint8)
    exp[4, 1] = 255
    with pytest.raises(ValueError, match=r"255 \(UE8M0 NaN\) at \[row, block\] \[4, 1\]"):
        HostTable(q, exp)
    with pytest.raises(ValueError, match="needs a row scale or block exponents"):
        HostTable(np.zeros((10, 64), np.float32), np.full((10, 2), 127, np.uint8))
