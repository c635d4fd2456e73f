"""Engram inside the backbone: placement, generation, data pipeline, optimizer group, sharding."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from v41jax import config as config_lib
from v41jax.config import ModelConfig
from v41jax.data import BatchIterator, CompressionTable
from v41jax.decode import decode_step, generate, prefill
from v41jax.engram import EngramConfig, ngram_hash_ids_np
from v41jax.engram.params import TABLE_GROUP as ENGRAM_TABLE_GROUP
from v41jax.model import Transformer, engram_ids_key
from v41jax.sharding import make_mesh
from v41jax.train import train
from v41jax.train.batches import add_engram_ids
from v41jax.train.optimizer import param_group_labels
from v41jax.train.state import make_state_fns, optimizer_config
from v41jax.train.step import make_train_step

V, V_PRIME = 64, 40
ENGRAM = EngramConfig(
    engram_vocab_size=(101, 103),
    max_ngram_size=3,
    n_embed_per_ngram=16,
    n_head_per_ngram=2,
    layer_ids=(0, 2),
    compressed_vocab_size=V_PRIME,
    table_row_align=8,
)
CFG = ModelConfig(
    vocab_size=V,
    d_model=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    max_seq_len=32,
    engram=ENGRAM,
)
COMPRESSION = np.random.default_rng(0).integers(0, V_PRIME, V).astype(np.int32)


def _extras(tokens):
    comp = COMPRESSION[np.asarray(tokens)]
    return {
        engram_ids_key(layer): jnp.asarray(ngram_hash_ids_np(comp, layer, ENGRAM))
        for layer in ENGRAM.layer_ids
    }


@pytest.fixture(scope="module")
def params():
    tokens = jnp.zeros((1, 8), jnp.int32)
    return Transformer(CFG).init(jax.random.PRNGKey(0), tokens, extras=_extras(tokens))["params"]


def test_engram_sits_at_its_layers_and_changes_the_output(params):
    assert "engram" in params["block_0"] and "engram" in params["block_2"]
    assert "engram" not in params["block_1"]
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, V)
    out = Transformer(CFG).apply({"params": params}, tokens, extras=_extras(tokens)).logits
    zeroed = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "engram" in str(p) and "w_v" in str(p) else x,
        nn.unbox(params),
    )
    plain = Transformer(CFG).apply({"params": zeroed}, tokens, extras=_extras(tokens)).logits
    assert float(jnp.abs(out - plain).max()) > 1e-4  # the memory is on the residual path
    with pytest.raises(ValueError, match="has an Engram module but extras has no 'engram_ids_0'"):
        Transformer(CFG).apply({"params": params}, tokens)


def test_incremental_decoding_equals_full_forward(params):
    """Hash ids computed on device from the rolled window while decoding give the same
    logits as hashing the whole sequence and running the full forward."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, V, (3, 14)).astype(np.int32)
    lengths = np.array([2, 5, 9], np.int32)
    full = (
        Transformer(CFG)
        .apply({"params": params}, jnp.asarray(tokens), extras=_extras(tokens))
        .logits
    )
    padded = np.where(np.arange(14) < lengths[:, None], tokens, 0)[:, :9]
    logits, state = prefill(
        params, CFG, jnp.asarray(padded), jnp.asarray(lengths), jnp.asarray(COMPRESSION)
    )
    np.testing.assert_allclose(logits, full[np.arange(3), lengths - 1], atol=2e-5)
    pos = lengths.copy()
    for _ in range(4):
        logits, state = decode_step(
            params,
            CFG,
            jnp.asarray(tokens[np.arange(3), pos]),
            state,
            jnp.asarray(pos),
            jnp.asarray(COMPRESSION),
        )
        np.testing.assert_allclose(logits, full[np.arange(3), pos], atol=2e-5)
        pos += 1
    out = generate(params, CFG, padded, lengths, max_new_tokens=4, compression=COMPRESSION)
    assert out.shape == (3, 4)
    with pytest.raises(ValueError, match="pass `compression`"):
        generate(params, CFG, padded, lengths, max_new_tokens=4)


def test_batches_carry_hash_ids_computed_ahead():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, 4000).astype(np.int32)
    segments = np.repeat(np.arange(40), 100).astype(np.int32)
    batch = BatchIterator(tokens, segments, 16, 4, seed=0).batch_at(3)
    table = CompressionTable(COMPRESSION, V_PRIME)
    out = add_engram_ids(batch, table, CFG)
    for layer in ENGRAM.layer_ids:
        want = ngram_hash_ids_np(
            COMPRESSION[batch["inputs"]], layer, ENGRAM, segment_ids=batch["segment_ids"]
        )
        np.testing.assert_array_equal(out[engram_ids_key(layer)], want)
        assert out[engram_ids_key(layer)].dtype == np.int32


def test_tables_get_their_own_optimizer_group():
    cfg = dataclasses.replace(config_lib.get_config("tiny"))
    cfg = config_lib.override(
        cfg,
        [
            "model.engram.layer_ids=1",
            "model.engram.n_embed_per_ngram=16",
            "model.engram.n_head_per_ngram=2",
            "model.engram.engram_vocab_size=101,103",
        ],
    )
    optim = optimizer_config(cfg)
    assert optim.param_groups[0].name == ENGRAM_TABLE_GROUP
    assert optim.param_groups[0].lr_scale == 5.0 and optim.param_groups[0].weight_decay == 0.0
    fake = {"block_1": {"engram": {"table": 0, "w_v": 0}}, "embed": {"embedding": 0}}
    labels = param_group_labels(fake, optim.param_groups)
    assert labels["block_1"]["engram"]["table"] == ENGRAM_TABLE_GROUP
    assert labels["block_1"]["engram"]["w_v"] == "default"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
def test_training_with_row_sharded_tables_matches_one_device(tmp_path):
    base = [
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=4",
        "model.engram.layer_ids=0",
        "model.engram.engram_vocab_size=1000,1000",
        "model.engram.n_embed_per_ngram=32",
        "model.engram.n_head_per_ngram=4",
    ]
    losses = {}
    for name, mesh in {"one": (1, 1, 1), "eight": (2, 4, 1)}.items():
        cfg = config_lib.override(
            config_lib.get_config("tiny"),
            base + [f"mesh.data={mesh[0]}", f"mesh.fsdp={mesh[1]}", f"mesh.tensor={mesh[2]}"],
        )
        train(cfg, str(tmp_path / name), progress=False)
        with open(os.path.join(tmp_path / name, "metrics.jsonl")) as f:
            losses[name] = [json.loads(x)["loss"] for x in f if '"loss"' in x]
        saved = config_lib.load_json(str(tmp_path / name / "config.json"))
        assert saved.model.engram.compressed_vocab_size > 0  # filled from the data
    np.testing.assert_allclose(losses["eight"], losses["one"], rtol=2e-5, atol=2e-5)
    # ...and on 8 devices the table really is row-sharded and read through the all-to-all.
    cfg = config_lib.load_json(str(tmp_path / "eight" / "config.json"))
    mesh = make_mesh(cfg.mesh)
    model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
    state = init_fn(0)
    table = state.params["block_0"]["engram"]["table"]
    assert table.sharding.spec == P(("data", "fsdp", "tensor"), None)
    assert table.addressable_shards[0].data.shape[0] == table.shape[0] // 8
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _tiny_batch(cfg).items()}
    with jax.set_mesh(mesh):
        hlo = step.jitted.lower(state, batch).as_text()
    assert "all-to-all" in hlo or "all_to_all" in hlo


def _tiny_batch(cfg):
    b, t, h = cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.engram.num_heads_total
    batch = {
        k: np.zeros((b, t), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")
    }
    batch["loss_mask"] = np.ones((b, t), np.float32)
    for layer in cfg.model.engram.layer_ids:
        batch[engram_ids_key(layer)] = np.zeros((b, t, h), np.int32)
    return batch
