"""Hugging Face checkpoints against `transformers` itself: the golden fixtures of
tests/fixtures/hf (scripts/make_hf_fixtures.py: tiny random Llama, Mistral, Qwen2, Qwen3
models, their input ids and fp32 logits from transformers) must give the same logits here;
export -> import is bit-exact; unsupported config fields are refused by name."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from v41jax.hf import FAMILIES, load_hf, model_config_from_hf, read_hf_config, save_hf
from v41jax.hf.checkpoint import tensor_files
from v41jax.model import Transformer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
# fp32 on CPU: the two implementations sum in different orders (XLA vs ATen); the logits
# (|logit| < 1) agree to ~1.3e-7, and the negative controls below move them by far more
ATOL = 1e-5


def golden(family):
    with np.load(os.path.join(FIXTURES, family, "golden.npz")) as f:
        return f["input_ids"], f["logits"]


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, scan):
    cfg, params = load_hf(os.path.join(FIXTURES, family), scan_layers=scan)
    ids, want = golden(family)
    got = np.asarray(Transformer(cfg).apply({"params": params}, jnp.asarray(ids)).logits)
    diff = float(np.abs(got - want).max())
    assert diff < ATOL, (family, diff)


@pytest.mark.parametrize(
    "family,change",
    [("qwen3", {"rope_theta": 1e4}), ("qwen3", {"qk_norm": False}),
     ("qwen2", {"attention_bias": False}), ("llama", {"norm_eps": 1e-2})],
)  # fmt: skip
def test_a_wrong_mapping_is_caught(family, change):
    """Negative controls: one setting of the mapping wrong moves the logits past ATOL."""
    import dataclasses

    cfg, params = load_hf(os.path.join(FIXTURES, family))
    wrong = dataclasses.replace(cfg, **change)
    if set(change) & {"qk_norm", "attention_bias"}:  # drop the params the change removes
        flat = dict(params)
        for block in (k for k in flat if k.startswith(("block_", "layers_"))):
            attn = dict(flat[block]["attn"])
            for key in ("q_norm", "k_norm", "q_bias", "k_bias", "v_bias"):
                attn.pop(key, None)
            flat[block] = {**flat[block], "attn": attn}
        params = flat
    ids, want = golden(family)
    got = np.asarray(Transformer(wrong).apply({"params": params}, jnp.asarray(ids)).logits)
    assert float(np.abs(got - want).max()) > 10 * ATOL


def test_each_family_maps_its_features():
    cfgs = {f: model_config_from_hf(read_hf_config(os.path.join(FIXTURES, f))) for f in FAMILIES}
    assert cfgs["qwen2"].attention_bias and not cfgs["qwen2"].qk_norm
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].resolved_head_dim == 16  # != 32 / 4
    assert cfgs["mistral"].num_kv_heads == 1 and cfgs["mistral"].rope_theta == 1e6
    assert not cfgs["llama"].tie_embeddings and cfgs["qwen2"].tie_embeddings
    assert len(tensor_files(os.path.join(FIXTURES, "llama"))) == 21  # read from 7 shards


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_is_bit_exact(family, tmp_path):
    src = os.path.join(FIXTURES, family)
    cfg, params = load_hf(src)
    out = str(tmp_path / family)
    save_hf(params, cfg, family, out, max_shard_bytes=16 << 10)  # several shards
    originals = {}
    for name, path in tensor_files(src).items():
        with safe_open(path, "np") as f:
            originals[name] = f.get_tensor(name)
    exported = {}
    for name, path in tensor_files(out).items():
        with safe_open(path, "np") as f:
            exported[name] = f.get_tensor(name)
    assert set(exported) == set(originals)
    for name, x in originals.items():
        np.testing.assert_array_equal(exported[name], x, err_msg=name)
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)


def _with(family, tmp_path, **changes):
    src = os.path.join(FIXTURES, family)
    dst = str(tmp_path / "m")
    shutil.copytree(src, dst)
    hf = read_hf_config(dst)
    hf.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    return dst


@pytest.mark.parametrize(
    "family,changes,match",
    [
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type"),
        (
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None},
            "rope_scaling",
        ),  # fmt: skip
        ("mistral", {"sliding_window": 4096}, "sliding_window=4096"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"model_type": "gemma"}, "model_type='gemma'"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_fields_are_refused_by_name(family, changes, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_hf(_with(family, tmp_path, **changes))


def test_wrong_shapes_and_stray_tensors_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers|no tensor for"):
        load_hf(_with("qwen2", tmp_path, num_hidden_layers=3))
    with pytest.raises(ValueError, match="shape"):
        load_hf(_with("llama", tmp_path / "b", intermediate_size=48))
