"""A damaged Hugging Face directory names itself in one line: `import-hf` exits 2 with
`error: ...` naming the file and the tensor (and what is wrong), and writes nothing; the
library (`load_hf`) raises the same ValueError / FileNotFoundError, never safetensors' own
SafetensorError or a bare json message. Each case damages a copy of a committed fixture
(qwen3: one model.safetensors; llama: 7 shards and an index)."""

import json
import os
import shutil

import numpy as np
import pytest

from v41jax.__main__ import main
from v41jax.hf import load_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
INDEX = "model.safetensors.index.json"


def _copy(family: str, dst) -> str:
    """A copy of the fixture with a tokenizer, so that it would import but for the damage."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    dst = str(dst / family)
    shutil.copytree(os.path.join(FIXTURES, family), dst)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return dst


def _refused(capsys, hf_dir: str, tmp_path, *expected: str) -> str:
    """Run import-hf on `hf_dir`: exit 2, one stderr line holding every `expected` text, no
    workdir written. Returns the line."""
    workdir = tmp_path / "w"
    assert main(["import-hf", hf_dir, "--workdir", str(workdir), "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, (text, err)
    assert not workdir.exists()
    return err


def _header(path: str) -> tuple[dict, bytes]:
    """(the header of a safetensors file, its data bytes)."""
    raw = open(path, "rb").read()
    (n,) = np.frombuffer(raw[:8], "<u8")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: str, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(np.uint64(len(text)).tobytes() + text + data)


def test_missing_directory_config_and_weights_are_named(capsys, tmp_path):
    _refused(capsys, str(tmp_path / "no" / "such"), tmp_path, "no/such does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, str(empty), tmp_path, f"{empty} holds no Hugging Face model (no config.json)")
    src = _copy("qwen3", tmp_path)
    os.remove(os.path.join(src, "model.safetensors"))
    _refused(capsys, src, tmp_path, f"{src} has no safetensors weights")


def test_cut_short_single_file_names_the_file_and_tensor(capsys, tmp_path):
    src = _copy("qwen3", tmp_path)
    path = os.path.join(src, "model.safetensors")
    header, data = _header(path)
    with open(path, "r+b") as f:  # the last 1000 bytes lost (the last two tensors)
        f.truncate(os.path.getsize(path) - 1000)
    name = "model.layers.1.self_attn.v_proj.weight"  # the first that lies past the end
    err = _refused(capsys, src, tmp_path, path, f"tensor {name}", "cut short? 2 tensors",
                   f"the file has {len(data) - 1000} bytes of data")  # fmt: skip
    assert "byte range 133376..137472" in err
    with pytest.raises(ValueError, match=f"tensor {name}.*cut short"):
        load_hf(src)  # the library says the same
    with open(path, "r+b") as f:  # cut inside the header
        f.truncate(100)
    _refused(capsys, src, tmp_path, path, "exceeds the file (100 bytes): cut short")


def test_a_header_that_lies_names_the_tensor(capsys, tmp_path):
    src = _copy("qwen3", tmp_path)
    path = os.path.join(src, "model.safetensors")
    header, data = _header(path)
    name = "model.layers.0.mlp.up_proj.weight"
    good = dict(header[name])
    header[name]["shape"] = [64, 48]  # a shape its bytes do not hold
    _write(path, header, data)
    _refused(capsys, src, tmp_path, path, f"tensor {name}", "header says F32[64, 48]",
             "(12288 bytes)", "(8192 bytes)")  # fmt: skip
    with pytest.raises(ValueError, match=f"tensor {name}: header says F32"):
        load_hf(src)
    begin, end = good["data_offsets"]
    header[name] = good | {"data_offsets": [begin + 64, end + 64]}  # into the next tensor
    _write(path, header, data)
    _refused(capsys, src, tmp_path, path, f"overlaps tensor {name}", "data_offsets lie")
    header[name] = good | {"data_offsets": [end, begin]}
    _write(path, header, data)
    _refused(capsys, src, tmp_path, path, f"tensor {name}", f"data_offsets [{end}, {begin}]")
    raw = json.dumps(header | {name: good}).encode()
    with open(path, "wb") as f:  # a header whose JSON is damaged
        f.write(np.uint64(len(raw)).tobytes() + raw[:-40] + b" " * 40 + data)
    _refused(capsys, src, tmp_path, path, f"the {len(raw)}-byte header is not valid JSON")


def test_one_lying_shard_is_named(capsys, tmp_path):
    src = _copy("llama", tmp_path)
    index = json.load(open(os.path.join(src, INDEX)))
    name = "model.layers.0.mlp.up_proj.weight"
    shard = os.path.join(src, index["weight_map"][name])
    header, data = _header(shard)
    header[name]["data_offsets"][1] += 4  # one tensor's range off by one F32
    _write(shard, header, data)
    _refused(capsys, src, tmp_path, shard, f"tensor {name}", "header says F32")
    with pytest.raises(ValueError, match=f"{os.path.basename(shard)}: tensor {name}"):
        load_hf(src)


def test_an_index_that_lies_is_named(capsys, tmp_path):
    src = _copy("llama", tmp_path)
    path = os.path.join(src, INDEX)
    index = json.load(open(path))
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][name])  # fmt: skip
    moved = {**index, "weight_map": {**index["weight_map"], name: wrong}}
    with open(path, "w") as f:  # the index puts the tensor in a shard that lacks it
        json.dump(moved, f)
    _refused(capsys, src, tmp_path, f"{os.path.join(src, wrong)} lacks tensor {name}", INDEX)
    with open(path, "w") as f:
        json.dump(index, f)
    shard = index["weight_map"][name]
    os.remove(os.path.join(src, shard))  # a shard missing
    _refused(capsys, src, tmp_path, f"{path} puts tensor", f"in {shard}, which {src} lacks")
    text = json.dumps(index, indent=2)
    with open(path, "w") as f:  # the index cut short
        f.write(text[: len(text) // 2])
    _refused(capsys, src, tmp_path, f"{path} is not valid JSON (line", "may be cut short")


def test_a_cut_short_config_json_is_named(capsys, tmp_path):
    src = _copy("qwen3", tmp_path)
    path = os.path.join(src, "config.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[: text.index('"model_type"') + 5])  # inside a key
    _refused(capsys, src, tmp_path, f"{path} is not valid JSON (line",
             "Unterminated string", "may be cut short")  # fmt: skip
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        load_hf(src)


def test_import_hf_as_a_library_names_a_missing_directory(tmp_path):
    """`import_hf` checks the directory first (`check_hf_dir`), before its tokenizer."""
    from v41jax.hf import check_hf_dir, import_hf

    missing, workdir = str(tmp_path / "no" / "such"), tmp_path / "w"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
        import_hf(missing, str(workdir), base="tiny")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_hf_dir(missing)
    assert not workdir.exists()
