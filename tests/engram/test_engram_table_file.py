import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from v41jax.engram import fp8
from v41jax.engram.table_file import (
    TableFile,
    create_table_file,
    init_rows,
    quantize_rows_np,
    restore_table_file,
)


def _dequant(tf: TableFile, ids):
    rows = np.asarray(tf.data[ids]).astype(np.float32)
    return rows * np.asarray(tf.scale[ids])[:, None] if tf.fp8 else rows


def test_init_is_per_row_normal_and_independent_of_chunks(tmp_path):
    a = init_rows(np.arange(4000), 128, seed=3, init_std=0.5)
    assert a.dtype == np.float32 and a.shape == (4000, 128)
    assert abs(a.mean()) < 0.01 and abs(a.std() - 0.5) < 0.01
    np.testing.assert_array_equal(init_rows([17, 3], 128, 3, 0.5), a[[17, 3]])
    assert not np.array_equal(init_rows([17], 128, 4, 0.5), a[[17]])  # the seed matters
    eager = create_table_file(str(tmp_path / "e"), 1001, 7, seed=3, init_std=0.5, lazy=False,
                              chunk_rows=64, progress=False)  # fmt: skip
    other = create_table_file(str(tmp_path / "f"), 1001, 7, seed=3, init_std=0.5, lazy=False,
                              chunk_rows=1000, threads=1, progress=False)  # fmt: skip
    lazy = create_table_file(str(tmp_path / "l"), 1001, 7, seed=3, init_std=0.5)
    want = init_rows(np.arange(1001), 7, 3, 0.5)
    for t in (eager, other, lazy):
        np.testing.assert_array_equal(t.gather(np.arange(1001)), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("lazy", [True, False])
def test_gather_update_round_trip(tmp_path, dtype, lazy):
    rng = np.random.default_rng(0)
    t = create_table_file(str(tmp_path / "t"), 5003, 16, dtype, seed=1, init_std=0.02,
                          lazy=lazy, threads=2, progress=False)  # fmt: skip
    ids = rng.integers(0, 5003, (3, 2000))  # large enough to split over threads
    init = init_rows(ids.reshape(-1), 16, 1, 0.02)
    if dtype == "float8_e4m3fn":
        q, s = quantize_rows_np(init)
        init = q.astype(np.float32) * s[:, None]
    elif dtype == "bfloat16":
        init = init.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = t.gather(ids)
    assert got.shape == (3, 2000, 16) and got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(-1, 16), init)
    up = np.unique(ids[0])
    new = rng.standard_normal((up.size, 16)).astype(np.float32)
    t.update_rows(up, new)
    want = np.asarray(_encode_decode(new, dtype))
    np.testing.assert_array_equal(t.gather(up), want)
    t.close()
    again = TableFile(str(tmp_path / "t"), mode="r")  # persisted, reopened read-only
    np.testing.assert_array_equal(again.gather(up), want)
    with pytest.raises(PermissionError, match="read-only"):
        again.update_rows(up[:1], new[:1])


def _encode_decode(rows, dtype):
    if dtype == "float8_e4m3fn":
        return np.asarray(fp8.dequantize_rows(*fp8.quantize_rows(jnp.asarray(rows))))
    return rows.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else rows


def test_fp8_rows_match_the_engram_fp8_format():
    rows = np.random.default_rng(2).standard_normal((50, 24)).astype(np.float32)
    rows[3] = 0.0
    q, s = quantize_rows_np(rows)
    jq, js = fp8.quantize_rows(jnp.asarray(rows))
    np.testing.assert_array_equal(s, np.asarray(js))
    np.testing.assert_array_equal(q.view(np.uint8), np.asarray(jq).view(np.uint8))


def test_snapshot_restore_is_exact_after_later_updates(tmp_path):
    rng = np.random.default_rng(3)
    t = create_table_file(str(tmp_path / "t"), 3001, 8, "bfloat16", seed=5)
    states = {}
    for step in (10, 20, 30):
        ids = np.unique(rng.integers(0, 3001, 400))
        t.update_rows(ids, rng.standard_normal((ids.size, 8)))
        t.snapshot(step)
        states[step] = t.gather(np.arange(3001))
    t.update_rows(np.arange(100), np.ones((100, 8)))  # after the last snapshot: not kept
    assert t.snapshots() == [10, 20, 30]
    with pytest.raises(ValueError, match="step 30 <= last snapshot 30"):
        t.snapshot(30)
    for step in (10, 20, 30):
        r = restore_table_file(str(tmp_path / "t"), step, str(tmp_path / f"r{step}"))
        np.testing.assert_array_equal(r.gather(np.arange(3001)), states[step])
        assert r.snapshots() == [s for s in (10, 20, 30) if s <= step]
    r = TableFile(str(tmp_path / "r20"))  # a restored table keeps logging consistently
    r.update_rows(np.array([7]), np.full((1, 8), 2.0))
    r.snapshot(25)
    back = restore_table_file(str(tmp_path / "r20"), 25, str(tmp_path / "r25"))
    np.testing.assert_array_equal(back.gather(np.arange(3001)), r.gather(np.arange(3001)))
    with pytest.raises(ValueError, match="no snapshot 15"):
        restore_table_file(str(tmp_path / "t"), 15, str(tmp_path / "x"))
    with pytest.raises(FileExistsError):
        restore_table_file(str(tmp_path / "t"), 10, str(tmp_path / "r10"))


def test_snapshot_survives_a_killed_writer_and_refuses_a_truncated_segment(tmp_path):
    t = create_table_file(str(tmp_path / "t"), 500, 4, "float8_e4m3fn", seed=1)
    t.update_rows(np.array([1, 2, 3]), np.ones((3, 4)))
    t.snapshot(1)
    at1 = t.gather(np.arange(500))
    t.update_rows(np.array([4, 5]), np.full((2, 4), 3.0))
    seg = t.snapshot(2)
    log = os.path.dirname(seg)
    with open(seg, "rb") as f:
        good = f.read()
    with open(os.path.join(log, ".tmp"), "wb") as f:  # a writer killed mid-write
        f.write(good[: len(good) // 2])
    assert t.snapshots() == [1, 2]  # the partial temp file is not a snapshot
    os.truncate(seg, len(good) - 5)  # a damaged committed segment is refused
    with pytest.raises(ValueError, match=r"step_000000000002.seg: .* truncated"):
        restore_table_file(str(tmp_path / "t"), 2, str(tmp_path / "r2"))
    assert not os.path.exists(tmp_path / "r2")
    with open(seg, "wb") as f:  # same size, one flipped byte: the CRC catches it
        f.write(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ValueError, match="CRC mismatch"):
        restore_table_file(str(tmp_path / "t"), 2, str(tmp_path / "r2"))
    r1 = restore_table_file(str(tmp_path / "t"), 1, str(tmp_path / "r1"))  # earlier: intact
    np.testing.assert_array_equal(r1.gather(np.arange(500)), at1)


def test_bad_inputs_are_named(tmp_path):
    t = create_table_file(str(tmp_path / "t"), 10, 4)
    with pytest.raises(ValueError, match="id 10 outside"):
        t.gather(np.array([1, 10]))
    with pytest.raises(ValueError, match="id -1 outside"):
        t.update_rows(np.array([-1]), np.zeros((1, 4)))
    with pytest.raises(TypeError, match="integers"):
        t.gather(np.array([1.0]))
    with pytest.raises(ValueError, match=r"rows \[n, 4\]"):
        t.update_rows(np.array([1, 2]), np.zeros((2, 5)))
    with pytest.raises(TypeError, match="floating"):
        t.update_rows(np.array([1]), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="distinct"):
        t.update_rows(np.array([1, 1]), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="dtype 'int8'"):
        create_table_file(str(tmp_path / "u"), 10, 4, "int8")
    with pytest.raises(FileExistsError):
        create_table_file(str(tmp_path / "t"), 10, 4)
    with pytest.raises(FileNotFoundError, match="no table at"):
        TableFile(str(tmp_path / "missing"))
    t.close()
    head = tmp_path / "t" / "header.json"
    h = json.loads(head.read_text())
    head.write_text(json.dumps({**h, "rows": 11}))
    with pytest.raises(ValueError, match=r"data.bin has 160 bytes but the header's shape"):
        TableFile(str(tmp_path / "t"))


def test_lazy_table_larger_than_memory_stays_sparse(tmp_path):
    rows, dim = 1 << 23, 128  # 4 GiB of float32 on disk, created instantly
    t = create_table_file(str(tmp_path / "big"), rows, dim, seed=9)
    assert os.path.getsize(tmp_path / "big" / "data.bin") == rows * dim * 4
    ids = np.array([0, 12345, rows // 2, rows - 1])
    np.testing.assert_array_equal(t.gather(ids), init_rows(ids, dim, 9, 0.02))
    t.update_rows(ids, np.ones((4, dim), np.float32))
    t.flush()
    np.testing.assert_array_equal(t.gather(ids), np.ones((4, dim)))
    assert t.allocated_bytes() < 8 << 20  # a few touched pages plus bitmaps, not 4 GiB
