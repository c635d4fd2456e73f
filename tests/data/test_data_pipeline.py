"""prepare_data (caching, packing) and BatchIterator (determinism, resume, sharding, segments)."""

import dataclasses
import json

import numpy as np
import pytest

from v41jax.config import DataConfig
from v41jax.data import pipeline, tokenizer
from v41jax.data.corpus import load_documents, split_documents
from v41jax.data.pipeline import (
    BatchIterator,
    eval_batches,
    prepare_data,
    segment_ids_and_positions,
)

KEYS = {"inputs", "targets", "segment_ids", "positions", "loss_mask"}


def small_cfg(cache_dir, **kw):
    base = dict(
        vocab_size=512,
        seq_len=64,
        global_batch_size=8,
        val_fraction=0.25,
        max_documents=8,
        cache_dir=str(cache_dir),
    )
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cfg = small_cfg(tmp_path_factory.mktemp("cache"))
    return cfg, prepare_data(cfg)


def test_prepare_data_layout(prepared):
    cfg, data = prepared
    assert (data.num_train_docs, data.num_val_docs) == (6, 2)
    assert data.tokenizer.vocab_size == cfg.vocab_size
    assert data.compression.vocab_size == cfg.vocab_size
    assert data.compression.compressed_vocab_size < cfg.vocab_size
    docs = load_documents([])[: cfg.max_documents]
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    for tokens, segments, split_docs in (
        (data.train_tokens, data.train_segments, train_docs),
        (data.val_tokens, data.val_segments, val_docs),
    ):
        assert tokens.dtype == np.int32 and segments.dtype == np.int32
        assert tokens.shape == segments.shape
        assert segments[0] == 0 and set(np.diff(segments).tolist()) <= {0, 1}
        assert segments[-1] == len(split_docs) - 1
        for i, doc in enumerate(split_docs):
            ids = tokens[segments == i]
            assert ids[-1] == data.tokenizer.eos_id  # the eos belongs to its document
            assert data.tokenizer.eos_id not in ids[:-1]
            assert data.tokenizer.decode(ids[:-1]) == doc.text


def test_prepare_data_warm_start_uses_caches(prepared, monkeypatch):
    cfg, data = prepared

    def fail(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(tokenizer, "train_tokenizer", fail)
    monkeypatch.setattr(pipeline, "_tokenize_docs", fail)
    again = prepare_data(cfg)
    assert again.tokenizer.content_hash == data.tokenizer.content_hash
    np.testing.assert_array_equal(again.train_tokens, data.train_tokens)
    np.testing.assert_array_equal(again.val_segments, data.val_segments)
    np.testing.assert_array_equal(again.compression.table, data.compression.table)


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("V41JAX_CACHE", str(tmp_path))
    prepare_data(small_cfg("", max_documents=4, vocab_size=300, seq_len=16, val_fraction=0.5))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and names[0].startswith("tokenizer-")
    assert all(n.startswith("tokens-") and n.endswith(".npz") for n in names[1:])


def test_prepare_data_errors(prepared, tmp_path):
    cfg, data = prepared
    val_windows = (len(data.val_tokens) - 1) // cfg.seq_len
    assert (len(data.train_tokens) - 1) // cfg.seq_len > val_windows + 1
    too_big = dataclasses.replace(cfg, global_batch_size=val_windows + 1)
    msg = rf"validation split has {len(data.val_tokens)} tokens in 2 documents: {val_windows} seq"
    with pytest.raises(ValueError, match=msg):
        prepare_data(too_big)
    with pytest.raises(ValueError, match=r"the train split has \d+ tokens in 3 documents"):
        prepare_data(small_cfg(tmp_path, max_documents=4, val_fraction=0.1, seq_len=4096))
    with pytest.raises(ValueError, match=r"cannot split 1 document"):
        prepare_data(small_cfg(tmp_path, max_documents=1))
    with pytest.raises(ValueError, match=r"data.seq_len=0 must be > 0"):
        prepare_data(small_cfg(tmp_path, seq_len=0))
    with pytest.raises(ValueError, match=r"data.max_documents=-1 must be >= 0"):
        prepare_data(small_cfg(tmp_path, max_documents=-1))
    with pytest.raises(FileNotFoundError, match=r"'/no/such/dir' does not exist"):
        prepare_data(small_cfg(tmp_path, paths=("/no/such/dir",)))


def hand_built():
    """Documents of lengths 3, 2, 6, 1, 5 (17 tokens); token value = position in the stream."""
    lengths = [3, 2, 6, 1, 5]
    segments = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return np.arange(len(segments), dtype=np.int32), segments


def test_segment_ids_and_positions_hand_built():
    tokens, segments = hand_built()
    it = BatchIterator(tokens, segments, seq_len=4, global_batch_size=4, seed=0, shuffle=False)
    assert it.num_windows == 4  # (17 - 1) // 4
    b = it.batch_at(0)
    assert set(b) == KEYS
    np.testing.assert_array_equal(b["inputs"], np.arange(16).reshape(4, 4))
    np.testing.assert_array_equal(b["targets"], np.arange(1, 17).reshape(4, 4))
    # stream docs: [0 1 2][3 4][5 6 7 8 9 10][11][12 13 14 15 16]
    np.testing.assert_array_equal(
        b["segment_ids"], [[1, 1, 1, 2], [1, 2, 2, 2], [1, 1, 1, 2], [1, 1, 1, 1]]
    )
    np.testing.assert_array_equal(
        b["positions"], [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 2, 0], [0, 1, 2, 3]]
    )
    for key, dtype in [("inputs", np.int32), ("segment_ids", np.int32), ("loss_mask", np.float32)]:
        assert b[key].dtype == dtype and b[key].shape == (4, 4)
    assert np.all(b["loss_mask"] == 1)
    ids, pos = segment_ids_and_positions(np.array([[7, 7, 8, 8, 8, 9]]))
    np.testing.assert_array_equal(ids, [[1, 1, 2, 2, 2, 3]])
    np.testing.assert_array_equal(pos, [[0, 1, 0, 1, 2, 0]])


def stream(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=n)
    segments = np.repeat(np.arange(n, dtype=np.int32), lengths)
    tokens = rng.integers(0, 500, size=len(segments), dtype=np.int32)
    return tokens, segments


def test_determinism_and_epochs():
    tokens, segments = stream()
    a = BatchIterator(tokens, segments, seq_len=32, global_batch_size=16, seed=3)
    b = BatchIterator(tokens, segments, seq_len=32, global_batch_size=16, seed=3)
    c = BatchIterator(tokens, segments, seq_len=32, global_batch_size=16, seed=4)
    for step in (0, 5, a.batches_per_epoch + 2):
        for key in KEYS:
            np.testing.assert_array_equal(a.batch_at(step)[key], b.batch_at(step)[key])
    assert not np.array_equal(a.batch_at(0)["inputs"], c.batch_at(0)["inputs"])
    # One epoch: distinct windows, remainder only num_windows % batch; targets shift inputs.
    starts, windows = [], tokens[: a.num_windows * 32].reshape(-1, 32)
    for step in range(a.batches_per_epoch):
        batch = a.batch_at(step)
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for row in batch["inputs"]:
            starts.append(int(np.flatnonzero((windows == row).all(axis=1))[0]))
    assert len(set(starts)) == a.batches_per_epoch * 16
    assert a.num_windows - len(set(starts)) == a.num_windows % 16
    # The next epoch is a different order.
    assert not np.array_equal(a.batch_at(0)["inputs"], a.batch_at(a.batches_per_epoch)["inputs"])


def test_resume_equals_uninterrupted():
    tokens, segments = stream()
    make = lambda: BatchIterator(tokens, segments, seq_len=16, global_batch_size=8, seed=7)
    straight = make()
    expected = [next(straight) for _ in range(40)]
    first = make()
    for _ in range(23):
        next(first)
    state = json.loads(json.dumps(first.state()))
    assert state["step"] == 23 and state["seed"] == 7 and state["num_windows"] == first.num_windows
    resumed = make()
    resumed.restore(state)
    for want in expected[23:]:
        got = next(resumed)
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key])


def test_restore_rejects_other_data():
    tokens, segments = stream()
    it = BatchIterator(tokens, segments, seq_len=16, global_batch_size=8, seed=0)
    state = it.state()
    other = BatchIterator(tokens, segments, seq_len=32, global_batch_size=8, seed=0)
    with pytest.raises(ValueError, match=r"seq_len: checkpoint 16 != now 32"):
        other.restore(state)
    changed = tokens.copy()
    changed[0] += 1
    with pytest.raises(ValueError, match=r"data_sha256: checkpoint"):
        BatchIterator(changed, segments, seq_len=16, global_batch_size=8, seed=0).restore(state)
    with pytest.raises(ValueError, match=r"missing \['step'\]"):
        it.restore({k: v for k, v in state.items() if k != "step"})


def test_process_sharding():
    tokens, segments = stream()
    kw = dict(seq_len=16, global_batch_size=8, seed=1)
    whole = BatchIterator(tokens, segments, **kw)
    shards = [
        BatchIterator(tokens, segments, **kw, process_index=p, process_count=4) for p in range(4)
    ]
    for step in (0, 9):
        parts = [s.batch_at(step) for s in shards]
        assert parts[0]["inputs"].shape == (2, 16)
        for key in KEYS:
            np.testing.assert_array_equal(
                np.concatenate([p[key] for p in parts]), whole.batch_at(step)[key]
            )


def test_eval_batches(prepared):
    cfg, data = prepared
    args = (data.val_tokens, data.val_segments, cfg.seq_len, cfg.global_batch_size)
    batches = eval_batches(*args, num_batches=2)
    assert len(batches) == 2 and set(batches[0]) == KEYS
    np.testing.assert_array_equal(batches[0]["inputs"][0], data.val_tokens[: cfg.seq_len])
    halves = [eval_batches(*args, 2, process_index=p, process_count=2) for p in range(2)]
    np.testing.assert_array_equal(
        np.concatenate([halves[0][1]["targets"], halves[1][1]["targets"]]), batches[1]["targets"]
    )
    possible = (len(data.val_tokens) - 1) // cfg.seq_len // cfg.global_batch_size
    with pytest.raises(ValueError, match=rf"at most {possible} batches of 8, but 999 were"):
        eval_batches(*args, num_batches=999)


def test_iterator_errors():
    tokens, segments = hand_built()
    with pytest.raises(
        ValueError, match=r"4 sequences of seq_len=4, fewer than one global batch of 8"
    ):
        BatchIterator(tokens, segments, seq_len=4, global_batch_size=8, seed=0)
    with pytest.raises(
        ValueError, match=r"global_batch_size=4 is not divisible by process_count=3"
    ):
        BatchIterator(tokens, segments, 4, 4, seed=0, process_index=0, process_count=3)
    with pytest.raises(ValueError, match=r"process_index < process_count, got 2 and 2"):
        BatchIterator(tokens, segments, 4, 4, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"equal length"):
        BatchIterator(tokens, segments[:-1], 4, 4, seed=0)
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        BatchIterator(tokens, segments, 4, 4, seed=-1)
    with pytest.raises(ValueError, match=r"step=-1 must be >= 0"):
        BatchIterator(tokens, segments, 4, 4, seed=0).batch_at(-1)


def test_config_is_frozen_dataclass():
    # prepare_data takes the shared DataConfig unchanged.
    assert dataclasses.is_dataclass(DataConfig) and DataConfig().vocab_size == 4096
