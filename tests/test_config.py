import dataclasses
import subprocess
import sys

import pytest

from v41jax import config as config_lib
from v41jax.config import Config, ModelConfig, ParamGroup


def test_named_configs_and_roundtrip(tmp_path):
    assert {"tiny", "small"} <= set(config_lib.named_configs())
    for name in ("tiny", "small"):
        cfg = config_lib.get_config(name)
        path = tmp_path / f"{name}.json"
        config_lib.save_json(cfg, str(path))
        assert config_lib.load_json(str(path)) == cfg


def test_override_parses_by_type():
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        [
            "train.steps=24",
            "optim.lr=1e-4",
            "model.tie_embeddings=false",
            "data.paths=a.txt,b",
            "name=x",
            "model.compute_dtype=bfloat16",
        ],
    )
    assert cfg.train.steps == 24 and cfg.optim.lr == 1e-4
    assert cfg.model.tie_embeddings is False and cfg.data.paths == ("a.txt", "b")
    assert cfg.name == "x" and cfg.model.compute_dtype == "bfloat16"
    groups = '[{"name": "tables", "pattern": "table$", "lr_scale": 5.0, "weight_decay": 0.0}]'
    cfg = config_lib.override(cfg, [f"optim.param_groups={groups}"])
    assert cfg.optim.param_groups == (ParamGroup("tables", "table$", 5.0, 0.0),)


def test_unknown_and_ill_typed_keys_are_named():
    cfg = config_lib.get_config("tiny")
    with pytest.raises(KeyError, match="train.stepz.*valid keys.*train.steps"):
        config_lib.override(cfg, ["train.stepz=3"])
    with pytest.raises(ValueError, match=r"train.steps='abc': expected int"):
        config_lib.override(cfg, ["train.steps=abc"])
    with pytest.raises(ValueError, match="expected a bool"):
        config_lib.override(cfg, ["model.tie_embeddings=maybe"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        config_lib.override(cfg, ["train.steps"])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": ModelConfig(vocab_size=100)}, "model.vocab_size=100 < data.vocab_size"),
        ({"model": ModelConfig(num_heads=4, num_kv_heads=3)}, "multiple of model.num_kv_heads"),
        ({"model": ModelConfig(compute_dtype="float64")}, "compute_dtype='float64'"),
        ({"model": ModelConfig(d_model=0)}, "model.d_model=0"),
    ],
)
def test_bad_configs_raise_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(Config(), **change)


def test_bad_values_via_override():
    cfg = config_lib.get_config("tiny")
    with pytest.raises(ValueError, match="train.steps=0"):
        config_lib.override(cfg, ["train.steps=0"])
    with pytest.raises(ValueError, match="generate.top_p=1.5"):
        config_lib.override(cfg, ["generate.top_p=1.5"])
    with pytest.raises(ValueError, match="unknown config 'nope'"):
        config_lib.get_config("nope")


@pytest.mark.parametrize(
    "key, good, bad",
    [
        ("model.attention_impl", "splash", "flash"),
        ("model.remat_policy", "dots_saveable", "fulll"),
        ("model.compute_dtype", "bfloat16", "bf16"),
        ("model.mhc.form", "single_pass", "singlepass"),
        ("model.mhc.single_pass_impl", "pallas", "triton"),
        ("model.engram.table_dtype", "float8_e4m3fn", "fp8"),
        ("optim.table_optimizer", "rowwise_adagrad", "adagrad"),
    ],
)
def test_string_enums_are_literals_and_refused_by_name(key, good, bad):
    """A field whose values are a fixed set is a `Literal` type, and --set takes one of them;
    anything else is refused naming the field, the value and the choices."""
    import typing

    from v41jax.config import text

    cfg = config_lib.get_config("tiny")
    leaf = text.to_dict(config_lib.override(cfg, [f"{key}={good}"]))
    for part in key.split("."):
        leaf = leaf[part]
    assert leaf == good
    name = key.rpartition(".")[2]
    with pytest.raises(ValueError, match=rf"{name}='{bad}' not in \("):
        config_lib.override(cfg, [f"{key}={bad}"])
    section, _, name = key.rpartition(".")
    owner = cfg
    for part in section.split("."):
        owner = getattr(owner, part)
    assert typing.get_origin(typing.get_type_hints(type(owner))[name]) is typing.Literal


def test_config_from_python_file(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text(
        "from v41jax.config import get_config as g\n"
        "import dataclasses\n"
        "def get_config():\n"
        "    return dataclasses.replace(g('tiny'), name='exp')\n"
    )
    assert config_lib.get_config(str(path)).name == "exp"
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(AttributeError, match="no get_config"):
        config_lib.get_config(str(bad))


@pytest.mark.e2e
def test_cli_help_lists_subcommands_and_rejects_bad_keys(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "v41jax", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("train", "eval", "generate", "bench"):
        assert cmd in out
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "v41jax",
            "train",
            "--config",
            "tiny",
            "--workdir",
            str(tmp_path / "w"),
            "--set",
            "train.bogus=1",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "train.bogus" in bad.stderr and "train.steps" in bad.stderr


def test_nested_overrides_are_validated_together():
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        [
            "model.engram.layer_ids=0,1",
            "model.engram.max_ngram_size=2",
            "model.engram.engram_vocab_size=1000",
        ],
    )
    assert cfg.model.engram.layer_ids == (0, 1)
    assert cfg.model.engram.engram_vocab_size == (1000,)
    with pytest.raises(ValueError, match=r"layer_ids=\(5,\): \[5\] >= num_layers=2"):
        config_lib.override(cfg, ["model.engram.layer_ids=5"])
    with pytest.raises(ValueError, match="engram_vocab_size=.* needs one size per order"):
        config_lib.override(cfg, ["model.engram.max_ngram_size=3"])


def test_feature_configs_round_trip_and_are_one_class(tmp_path):
    """EngramConfig / MHCConfig live in the config layer; the feature packages re-export the
    same classes, and a config using both survives the JSON round trip."""
    from v41jax.engram.config import EngramConfig
    from v41jax.mhc.config import MHCConfig

    assert EngramConfig is config_lib.EngramConfig and MHCConfig is config_lib.MHCConfig
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        [
            "model.engram.layer_ids=1",
            "model.engram.max_ngram_size=2",
            "model.engram.engram_vocab_size=1009",
            "model.mhc.n_streams=2",
            "model.mhc.form=single_pass",
        ],
    )
    assert cfg.model.engram == EngramConfig(
        layer_ids=(1,), max_ngram_size=2, engram_vocab_size=(1009,)
    )
    assert cfg.model.mhc == MHCConfig(n_streams=2, form="single_pass")
    path = tmp_path / "cfg.json"
    config_lib.save_json(cfg, str(path))
    assert config_lib.load_json(str(path)) == cfg
    with pytest.raises(ValueError, match="MHCConfig: form='bogus'"):
        config_lib.override(cfg, ["model.mhc.form=bogus"])


@pytest.mark.parametrize(
    "key, suggested",
    [
        ("train.step", ["train.steps"]),
        ("trian.steps", ["train.steps"]),
        ("model.engram.layers", ["model.engram.layer_ids"]),
        ("model.num_layer", ["model.num_layers"]),
        ("train.lr", ["optim.lr"]),  # the field, in another section
        ("steps", ["train.steps"]),
        ("nam", ["name"]),
    ],
)
def test_unknown_key_suggests_the_closest(key, suggested):
    with pytest.raises(KeyError) as e:
        config_lib.override(config_lib.get_config("tiny"), [f"{key}=1"])
    (msg,) = e.value.args  # one line: the CLI prints KeyError's argument
    assert f"unknown config key {key!r} (did you mean " in msg and "\n" not in msg
    hint = msg.split("(did you mean ", 1)[1].split("?)", 1)[0]
    for s in suggested:
        assert repr(s) in hint


def test_unknown_key_lists_only_its_section():
    cfg = config_lib.get_config("tiny")
    with pytest.raises(KeyError) as e:
        config_lib.override(cfg, ["train.step=3"])
    listing = e.value.args[0].split("valid keys of train: ", 1)[1].split(", ")
    assert "train.steps" in listing and all(k.startswith("train.") for k in listing)
    with pytest.raises(KeyError) as e:  # nested sections show as `section.*`
        config_lib.override(cfg, ["model.bogus=3"])
    msg = e.value.args[0]
    assert "did you mean" not in msg and "model.engram.*" in msg and "model.d_model" in msg
    assert "model.engram.layer_ids" not in msg and "train." not in msg
    with pytest.raises(KeyError) as e:  # no known section: the section names
        config_lib.override(cfg, ["bogus=3"])
    assert e.value.args[0].endswith(
        "valid keys (sections end in .*): data.*, generate.*, mesh.*, model.*, name, optim.*, "
        "train.*"
    )
    with pytest.raises(KeyError, match="'model.engram' is a section, not a field"):
        config_lib.override(cfg, ["model.engram=3"])


def test_from_dict_unknown_key_suggests_the_closest():
    with pytest.raises(KeyError, match=r"\['step'\] in train; did you mean 'steps'\? valid"):
        config_lib.from_dict(Config, {"train": {"step": 3}})


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("train.steps", r"--set 'train.steps': expected KEY=VALUE, e.g. --set train.steps=VALUE"),
        ("=3", r"--set '=3': missing the KEY before '='"),
        (" =3", r"--set ' =3': missing the KEY before '='"),
        ("", r"--set '': expected KEY=VALUE"),
        ("train.steps=", r"train.steps='': expected int"),
    ],
)
def test_malformed_set_names_the_value(assignment, message):
    with pytest.raises(ValueError, match=message):
        config_lib.override(config_lib.get_config("tiny"), [assignment])
