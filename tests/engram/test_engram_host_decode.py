"""Decoding and evaluation with Engram tables in host memory or a memory-mapped file
(`HostRows`): outputs equal the same model with device tables, for generate, speculative and
DSpark decoding; a decode step reads only the B x H rows of its tokens; bad inputs named."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.decode import SamplingParams, generate, speculative_generate
from v41jax.dspark.decode.engine import dspark_generate
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import Drafter, frozen_target
from v41jax.engram import EngramConfig, engram_forward, flat_row_ids, ngram_hash_ids_np
from v41jax.engram.fp8 import quantize_blocks_np
from v41jax.engram.host_rows import HostRows
from v41jax.engram.host_table import HostTable
from v41jax.engram.table_file import TableFile, create_table_file
from v41jax.model import Transformer, engram_ids_key, init_params
from v41jax.model.host_params import engram_tables, tables_on_host

V = 48
ENGRAM = EngramConfig(
    engram_vocab_size=(101, 103),
    max_ngram_size=3,
    n_embed_per_ngram=32,
    n_head_per_ngram=2,
    layer_ids=(1, 2),
    compressed_vocab_size=V,
    table_row_align=8,
)
CFG = ModelConfig(
    vocab_size=V, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=64,
    max_seq_len=48, engram=ENGRAM, init_std=0.3,
)  # fmt: skip
COMPRESSION = np.arange(V, dtype=np.int32)
PROMPTS = np.random.default_rng(0).integers(0, V, (3, 7)).astype(np.int32)
LENGTHS = np.array([7, 2, 5], np.int32)


@functools.cache
def params():
    return init_params(CFG, jax.random.key(0))


def tables():
    return {layer: np.asarray(t) for layer, t in engram_tables(params()).items()}


class CountingTable(HostTable):
    """A HostTable that records how many ids each gather read."""

    def __init__(self, table):
        super().__init__(table)
        self.reads = []

    def gather(self, ids):
        self.reads.append(np.size(ids))
        return super().gather(ids)


@pytest.fixture(scope="module")
def file_tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    out = {}
    for layer, t in tables().items():
        tf = create_table_file(str(root / f"l{layer}"), *t.shape, progress=False)
        tf.update_rows(np.arange(t.shape[0]), t)
        tf.flush()
        out[layer] = TableFile(str(root / f"l{layer}"), mode="r")
    return out


def _generate(p, **kw):
    return np.asarray(
        generate(p, CFG, PROMPTS, LENGTHS, max_new_tokens=9, compression=COMPRESSION, **kw)
    )


@pytest.mark.parametrize(
    "source", ["host", pytest.param("numpy", marks=pytest.mark.slow), "file"]
)  # a numpy source is read like a HostTable's own array
def test_generate_with_host_tables_equals_device_tables(source, file_tables):
    srcs = {"host": {k: HostTable(v) for k, v in tables().items()},
            "numpy": tables(), "file": file_tables}[source]  # fmt: skip
    host = tables_on_host(params(), CFG, srcs)
    assert not any(isinstance(x, jax.Array) and x.size > 10_000 for x in jax.tree.leaves(host))
    t1 = SamplingParams(temperature=1.0)
    want = _generate(params(), sampling=t1, rng=jax.random.key(3))
    np.testing.assert_array_equal(_generate(host, sampling=t1, rng=jax.random.key(3)), want)
    np.testing.assert_array_equal(_generate(host), _generate(params()))  # greedy


def test_the_full_forward_and_eval_logits_are_equal():
    comp = COMPRESSION[PROMPTS]
    extras = {
        engram_ids_key(layer): jnp.asarray(ngram_hash_ids_np(comp, layer, ENGRAM))
        for layer in ENGRAM.layer_ids
    }
    host = tables_on_host(params(), CFG)  # default: the params' own tables, copied to host
    fwd = jax.jit(lambda p, t, e: Transformer(CFG).apply({"params": p}, t, extras=e).logits)
    np.testing.assert_array_equal(fwd(host, PROMPTS, extras), fwd(params(), PROMPTS, extras))


def test_a_decode_step_reads_only_its_tokens_rows(monkeypatch):
    monkeypatch.setenv("V41JAX_HOST_GATHER", "callback")  # count the reads in Python
    counting = {k: CountingTable(v) for k, v in tables().items()}
    host = tables_on_host(params(), CFG, counting)
    new = 6
    generate(host, CFG, PROMPTS, LENGTHS, max_new_tokens=new, compression=COMPRESSION)
    heads, b = ENGRAM.num_heads_total, PROMPTS.shape[0]
    for table in counting.values():  # prefill: B x P x H ids; each decode step: B x H
        assert table.reads == [b * PROMPTS.shape[1] * heads] + [b * heads] * (new - 1)


def test_speculative_decoding_with_host_target_tables():
    draft_cfg = dataclasses.replace(CFG, num_layers=1, engram=EngramConfig())
    dp = init_params(draft_cfg, jax.random.key(1))
    host = tables_on_host(params(), CFG)

    def run(tp):
        return np.asarray(speculative_generate(
            tp, CFG, dp, draft_cfg, PROMPTS, LENGTHS, max_new_tokens=9, num_draft=3,
            compression=COMPRESSION,
        ).tokens)  # fmt: skip

    np.testing.assert_array_equal(run(host), run(params()))
    np.testing.assert_array_equal(run(host), _generate(params()))  # greedy: lossless


def test_dspark_decoding_with_host_target_tables():
    dcfg = DrafterConfig(block_size=3, num_layers=1, num_heads=4, window=16, markov_rank=4)
    frozen = frozen_target(params(), CFG)
    f = len(dcfg.layer_ids_for(CFG.num_layers)) * CFG.d_model
    dp = Drafter(dcfg, CFG).init(
        jax.random.key(2), frozen, np.zeros((1, 2, f), np.float32),
        np.arange(2, dtype=np.int32)[None], np.ones((1, 2), bool),
        np.zeros((1, 1), np.int32), np.ones((1, 1), np.int32),
    )["params"]  # fmt: skip
    host = tables_on_host(params(), CFG)

    def run(tp):
        out = dspark_generate(
            tp, CFG, dp, dcfg, frozen, PROMPTS, LENGTHS, max_new_tokens=9,
            compression=COMPRESSION,
        )  # fmt: skip
        return np.asarray(out.tokens)

    np.testing.assert_array_equal(run(host), run(params()))
    np.testing.assert_array_equal(run(host), _generate(params()))


def test_fp8_block_host_tables_decode_like_their_dequantised_device_tables():
    q = {k: quantize_blocks_np(t, block=8) for k, t in tables().items()}  # e4m3, exponents
    host = tables_on_host(params(), CFG, {k: HostTable(d, e) for k, (d, e) in q.items()})
    deq = {k: HostTable(d, e).gather(np.arange(d.shape[0])[:, None]) for k, (d, e) in q.items()}
    device = tables_on_host(params(), CFG, deq)  # the dequantised values, float32
    assert any(not np.array_equal(deq[k], t) for k, t in tables().items())  # fp8 rounded
    np.testing.assert_array_equal(_generate(host), _generate(device))


def test_engram_forward_reads_a_host_rows_table():
    rng = np.random.default_rng(1)
    layer = 1
    plain = nn.unbox(params())[f"block_{layer}"]["engram"]
    ids = jnp.asarray(ngram_hash_ids_np(rng.integers(0, V, (2, 5)), layer, ENGRAM))
    h = jnp.asarray(rng.normal(size=(2, 5, CFG.d_model)), jnp.float32)
    want = engram_forward(plain, h, ids, ENGRAM, layer)
    got = jax.jit(lambda p, h, i: engram_forward(p, h, i, ENGRAM, layer))(
        {**plain, "table": HostRows(np.asarray(plain["table"]))}, h, ids
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    flat = np.asarray(flat_row_ids(ENGRAM, layer, ids))
    np.testing.assert_array_equal(
        HostRows(np.asarray(plain["table"])).read(flat), np.asarray(plain["table"])[flat]
    )


def test_bad_host_tables_are_named():
    t = tables()
    with pytest.raises(ValueError, match=r"layers \[1\] but model.engram.layer_ids=\[1, 2\]"):
        tables_on_host(params(), CFG, {1: t[1]})
    with pytest.raises(ValueError, match="layer 2 has shape"):
        tables_on_host(params(), CFG, {1: t[1], 2: t[2][:-8]})
    with pytest.raises(TypeError, match="HostTable, a TableFile or a numpy array"):
        HostRows([[0.0]])
    with pytest.raises(ValueError, match="outside"):
        HostRows(t[1]).read(np.array([t[1].shape[0]]))
    with pytest.raises(TypeError, match="integers"):
        HostRows(t[1]).read(np.array([0.5]))
