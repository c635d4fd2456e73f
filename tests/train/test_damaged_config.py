"""A damaged JSON file names itself: a workdir's config.json cut short is refused by `train`
and `eval` (and `load_run`) in one line naming the file, where it breaks and that it may be
cut short, not json's bare "Unterminated string starting at: line 11 column 5"; the reader
behind it (`config.read_json`) says the same of any JSON file v41jax reads."""

import json

import pytest
from etils import epath

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.train import load_run
from v41jax.train.workdir import save_config


@pytest.fixture
def cut_config(tmp_path):
    """(a workdir whose config.json stops inside a string, that file's path)."""
    path = tmp_path / "run" / "config.json"
    path.parent.mkdir()
    save_config(config_lib.get_config("tiny"), epath.Path(path))
    text = path.read_text()
    path.write_text(text[: text.index('"name"') + 3])
    return str(path.parent), str(path)


def test_cut_short_workdir_config_is_named_by_the_cli(cut_config, capsys):
    workdir, path = cut_config
    before = sorted(p.name for p in epath.Path(workdir).iterdir())
    for argv in (["train", "--workdir", workdir], ["eval", "--workdir", workdir]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} is not valid JSON (line ") and err.count("\n") == 1
        assert "Unterminated string starting at); it stops mid-value" in err
        assert "may be cut short" in err
    assert sorted(p.name for p in epath.Path(workdir).iterdir()) == before  # nothing written
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        load_run(workdir)
    assert main(["train", "--config", path, "--workdir", workdir + "2"]) == 2  # --config F.json
    assert f"error: {path} is not valid JSON" in capsys.readouterr().err


def test_what_is_wrong_is_said(tmp_path):
    path = tmp_path / "f.json"
    path.write_text('{"a": 1,\n "b" 2,\n "c": 3}')  # broken in the middle: not cut short
    mid = r"f.json is not valid JSON \(line 2 column 6: Expecting ':' delimiter\)$"
    with pytest.raises(ValueError, match=mid):
        config_lib.read_json(str(path))
    path.write_text('{"a": [1, 2')
    with pytest.raises(ValueError, match="line 1 column 12: Expecting ',' delimiter.*cut short"):
        config_lib.read_json(epath.Path(path))  # an epath (any workdir) as a local path
    path.write_text('{"a": tr')
    with pytest.raises(ValueError, match="cut short"):
        config_lib.read_json(path)
    path.write_text("")
    with pytest.raises(ValueError, match=r"f.json is empty \(0 bytes\), not JSON"):
        config_lib.read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="f.json is not JSON text .byte 7 is not UTF-8"):
        config_lib.read_json(path)
    path.write_text('{"a": 1}')
    assert config_lib.read_json(path) == {"a": 1}


def test_a_config_json_with_unknown_keys_or_no_object_is_named(tmp_path, capsys):
    path = tmp_path / "run" / "config.json"
    path.parent.mkdir()
    d = config_lib.to_dict(config_lib.get_config("tiny"))
    path.write_text(json.dumps(d | {"trian": {}}))
    assert main(["train", "--workdir", str(path.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: unknown config keys ['trian']") and "'train'" in err
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{path} holds a JSON list, not a config"):
        config_lib.load_json(str(path))
