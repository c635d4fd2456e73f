"""Token files (`prepare-data`, `data.token_dir`): the in-memory path's batches from memmaps,
rows partitioned over processes, exact resume of a run that reads them, clear errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.data import (
    BatchIterator,
    DocumentIndex,
    eval_batches,
    load_token_dir,
    prepare_data,
    read_manifest,
    train_tokenizer,
    write_token_dir,
)
from v41jax.data import pipeline as pipeline_lib
from v41jax.data.token_files import token_dtype


@pytest.fixture(scope="module")
def tiny():
    return config_lib.get_config("tiny")


@pytest.fixture(scope="module")
def token_dir(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tokens") / "tiny")
    write_token_dir(tiny, out)
    return out


def _data_cfg(cfg, token_dir, *sets):
    return config_lib.override(cfg, [f"data.token_dir={token_dir}", *sets]).data


def _iterator(data, process_index=0, process_count=1, seq_len=64, batch=8):
    return BatchIterator(
        data.train_tokens,
        data.train_segments,
        seq_len,
        batch,
        seed=0,
        process_index=process_index,
        process_count=process_count,
        data_sha256=data.train_sha256,
    )


def test_token_file_batches_equal_the_in_memory_batches(tiny, token_dir):
    memory, files = prepare_data(tiny.data), load_token_dir(_data_cfg(tiny, token_dir))
    manifest = read_manifest(token_dir)
    assert manifest["dtype"] == "uint16" and manifest["data"]["max_documents"] == 24
    assert manifest["splits"]["train"]["tokens"] == len(memory.train_tokens)
    assert isinstance(files.train_tokens, np.memmap) and files.train_tokens.dtype == np.uint16
    assert isinstance(files.train_segments, DocumentIndex)
    assert files.tokenizer.content_hash == memory.tokenizer.content_hash
    np.testing.assert_array_equal(files.compression.table, memory.compression.table)
    for split in ("train", "val"):
        tokens = getattr(files, f"{split}_tokens")
        np.testing.assert_array_equal(tokens, getattr(memory, f"{split}_tokens"))
        segments = getattr(files, f"{split}_segments")
        np.testing.assert_array_equal(
            segments[np.arange(len(tokens))], getattr(memory, f"{split}_segments")
        )
    a, b = _iterator(memory), _iterator(files)
    assert a.state() == b.state()  # a checkpoint of one path restores in the other
    epoch = a.batches_per_epoch
    for step in (0, 1, 2, epoch - 1, epoch, 3 * epoch + 5):  # across reshuffled epochs
        x, y = a.batch_at(step), b.batch_at(step)
        assert sorted(x) == sorted(y)
        for k in x:
            assert x[k].dtype == y[k].dtype, k
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"step {step} {k}")
    val = [eval_batches(d.val_tokens, d.val_segments, 64, 8, 2) for d in (memory, files)]
    for x, y in zip(*val, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_process_rows_partition_the_global_batch_and_read_no_whole_array(
    tiny, token_dir, monkeypatch
):
    data = load_token_dir(_data_cfg(tiny, token_dir))
    whole = _iterator(data)
    for count in (2, 4, 8):
        parts = [_iterator(data, i, count) for i in range(count)]
        for step in (0, 7, whole.batches_per_epoch + 1):
            rows = [p.batch_at(step) for p in parts]
            assert all(r["inputs"].shape == (8 // count, 64) for r in rows)
            glob = whole.batch_at(step)
            for k in glob:
                np.testing.assert_array_equal(np.concatenate([r[k] for r in rows]), glob[k])
    # The iterator keeps views of the file, and its checkpoint state hashes nothing.
    assert np.shares_memory(whole.tokens, data.train_tokens)
    monkeypatch.setattr(pipeline_lib, "stream_sha256", lambda *a: pytest.fail("hashed"))
    assert (
        whole.state()["data_sha256"] == read_manifest(token_dir)["splits"]["train"]["stream_sha256"]
    )


def test_document_index():
    index = DocumentIndex(np.array([0, 3, 4, 7], np.int64))
    assert index.shape == (7,) and len(index) == 7
    np.testing.assert_array_equal(index[np.arange(7)], [0, 0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(index), [0, 0, 0, 1, 2, 2, 2])
    with pytest.raises(IndexError, match=r"\[5, 7\] outside \[0, 7\)"):
        index[np.array([5, 7])]


def test_other_seq_len_and_batch_read_the_same_folder(tiny, token_dir):
    data = load_token_dir(_data_cfg(tiny, token_dir, "data.seq_len=32"))
    assert _iterator(data, seq_len=32, batch=4).batch_at(3)["inputs"].shape == (4, 32)
    with pytest.raises(ValueError, match="validation split .* data.seq_len=1024"):
        load_token_dir(_data_cfg(tiny, token_dir, "data.seq_len=1024"))


def test_token_dtype():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="vocab_size=0"):
        token_dtype(0)


def _copy(token_dir, tmp_path):
    return shutil.copytree(token_dir, str(tmp_path / "copy"))


def test_bad_folders_are_clear_errors(tiny, token_dir, tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"data.token_dir={missing} does not exist"):
        load_token_dir(_data_cfg(tiny, missing))
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        load_token_dir(_data_cfg(tiny, str(tmp_path)))
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        write_token_dir(tiny, token_dir)
    bad = _copy(token_dir, tmp_path)
    path = os.path.join(bad, "manifest.json")
    manifest = read_manifest(bad)

    def expect(match, edit=None, file=None, content=b"", cfg=tiny.data):
        if edit is not None:
            with open(path, "w") as f:
                json.dump({**manifest, **edit}, f)
        if file is not None:
            with open(os.path.join(bad, file), "wb") as f:
                f.write(content)
        with pytest.raises(ValueError, match=match):
            load_token_dir(config_lib.override(tiny, [f"data.token_dir={bad}"]).data)
        with open(path, "w") as f:
            json.dump(manifest, f)

    expect("format version 99", edit={"version": 99})
    expect("manifest.json is not a v41jax-token-dir manifest", edit={"format": "other"})
    expect("train_tokens.npy is uint16 .* the manifest says uint32", edit={"dtype": "uint32"})
    expect("manifest.json is unreadable", file="manifest.json", content=b"{not json")
    with open(os.path.join(bad, "validation_tokens.npy"), "rb") as f:
        head = f.read(200)  # the header, and too few tokens after it
    expect("validation_tokens.npy is unreadable", file="validation_tokens.npy", content=head)


def test_a_folder_that_disagrees_with_the_config_names_the_field(tiny, token_dir, tmp_path):
    for sets, match in (
        (["data.max_documents=5"], "data.max_documents=5 but it was prepared with "),
        (["data.val_fraction=0.2"], "data.val_fraction=0.2 but .* data.val_fraction=0.05"),
        (["data.seed=3"], "data.seed=3 but it was prepared with data.seed=0"),
        (["data.vocab_size=1024", "model.vocab_size=1024"], "data.vocab_size=1024 but"),
        (["data.paths=texts/"], r"data.paths=\['texts/'\] but it was prepared with .*\[\]"),
    ):
        with pytest.raises(ValueError, match=match):
            load_token_dir(_data_cfg(tiny, token_dir, *sets))
    rng = np.random.default_rng(0)  # random words: enough distinct pairs for 512 tokens
    words = ["".join(rng.choice(list("abcdefghij"), 5)) for _ in range(3000)]
    other = train_tokenizer([" ".join(words)], 512)
    with pytest.raises(ValueError, match="was tokenized with tokenizer .* this run uses"):
        load_token_dir(_data_cfg(tiny, token_dir), tokenizer=other)
    bad = _copy(token_dir, tmp_path)
    other.save(os.path.join(bad, "tokenizer.json"))
    with pytest.raises(ValueError, match="not the tokenizer its tokens were made with"):
        load_token_dir(_data_cfg(tiny, bad))
    with pytest.raises(ValueError, match="data.token_dir=' x' has leading or trailing"):
        config_lib.override(tiny, ["data.token_dir= x"])


def test_train_refuses_a_missing_folder_and_writes_nothing(tmp_path, capsys):
    workdir, missing = tmp_path / "run", tmp_path / "nope"
    argv = ["train", "--config", "tiny", "--workdir", str(workdir), "--no-progress"]
    assert main([*argv, "--set", f"data.token_dir={missing}"]) == 2
    assert f"data.token_dir={missing} does not exist" in capsys.readouterr().err
    assert not workdir.exists()


STEPS = 24


def _train_cmd(workdir, *sets):
    args = [f"train.steps={STEPS}", "train.checkpoint_every=4", "train.log_every=1"]
    args += ["train.eval_every=0", *sets]
    flags = [x for s in args for x in ("--set", s)]
    base = [sys.executable, "-m", "v41jax", "train", "--config", "tiny", "--workdir"]
    return [*base, str(workdir), *flags, "--no-progress"]


def _losses(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.e2e
def test_training_from_a_token_dir_resumes_exactly(tmp_path):
    """prepare-data on the CLI; a token-dir run killed mid-run and rerun gives, step for
    step, the losses of an uninterrupted run of the in-memory path."""
    out = tmp_path / "tokens"
    prep = subprocess.run(
        [sys.executable, "-m", "v41jax", "prepare-data", "--config", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert prep.returncode == 0, prep.stderr
    assert json.loads(prep.stdout)["dtype"] == "uint16"
    reference = tmp_path / "memory"
    subprocess.run(_train_cmd(reference), check=True, capture_output=True)
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))

    run, cmd = tmp_path / "files", _train_cmd(tmp_path / "files", f"data.token_dir={out}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if max(_losses(run), default=0) >= 10:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    output = proc.communicate(timeout=240)[0].decode()
    assert proc.returncode == -signal.SIGKILL, output
    assert max(_losses(run)) < STEPS, "the run finished before the kill; nothing was tested"
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed from" in rerun.stdout
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(resumed[step] - expected[step]) <= 1e-6, (step, resumed[step], expected[step])
