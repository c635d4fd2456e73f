"""Train-state shardings come from the params' logical annotations in one pass
(`sharding.tree_shardings` on the abstract, boxed state): equal to the specs the earlier
path-suffix matching gave (recorded in state_shardings_expected.json for the tiny config,
Engram + mHC with dense and row-sparse table optimizers, and MoE, on meshes data=2 x fsdp=4
and data=2 x fsdp=2 x tensor=2); a dimension the mesh cannot divide warns, naming the
parameter, its shape, the logical axis and the mesh axes, and is replicated along that dim."""

import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.config import MeshConfig
from v41jax.sharding import ShardingWarning, make_mesh
from v41jax.train.state import make_state_fns

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
EXPECTED = json.loads((pathlib.Path(__file__).parent / "state_shardings_expected.json").read_text())
ENGRAM = [
    "model.engram.layer_ids=0,1",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
]
MHC = ["model.mhc.n_streams=4"]
MOE = ["model.moe.num_experts=4", "model.moe.num_shared_experts=1", "model.moe.d_expert=48"]
CONFIGS = {
    "tiny": [],
    "engram_mhc": ENGRAM + MHC,
    "engram_mhc_sparse": ENGRAM + MHC + ["optim.table_optimizer=sparse_adam"],
    "moe": MOE,
}
MESHES = {"data2_fsdp4": (2, 4, 1), "data2_fsdp2_tensor2": (2, 2, 2)}


def _cfg(overrides, mesh):
    data, fsdp, tensor = mesh
    mesh_set = [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"]
    return config_lib.override(config_lib.get_config("tiny"), overrides + mesh_set)


def _specs(tree) -> dict:
    """{key path: spec as JSON lists} of a tree of NamedShardings."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    as_json = lambda a: list(a) if isinstance(a, tuple) else a  # noqa: E731
    return {jax.tree_util.keystr(p): [as_json(a) for a in s.spec] for p, s in flat}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_shardings_equal_the_recorded_ones(config, mesh):
    cfg = _cfg(CONFIGS[config], MESHES[mesh])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)  # every dimension divides here
        _, _, _, shardings, abstract = make_state_fns(cfg, make_mesh(cfg.mesh))
    assert _specs(shardings) == EXPECTED[f"{config}/{mesh}"]
    # the restore target carries the same shardings
    assert _specs(jax.tree.map(lambda x: x.sharding, abstract)) == _specs(shardings)


def test_indivisible_dimension_warns_naming_the_parameter():
    cfg = _cfg([], (1, 1, 8))  # 4 query heads and 2 KV heads over tensor=8
    with pytest.warns(ShardingWarning) as record:
        _, _, _, shardings, _ = make_state_fns(cfg, make_mesh(cfg.mesh))
    messages = [str(w.message) for w in record]
    q = [m for m in messages if m.startswith("params/layers_0_1/attn/q")]
    assert len(q) == 1, messages
    assert "[2, 64, 4, 16]" in q[0] and "dim 2" in q[0] and "'heads'" in q[0]
    assert "('tensor',)" in q[0] and "size 8" in q[0]
    assert any(m.startswith("params/layers_0_1/attn/k") and "'kv_heads'" in m for m in messages)
    # replicated along the heads dim only; the moments follow their param
    assert shardings.params["layers_0_1"]["attn"]["q"].spec == P(None, None, None, None)
    assert shardings.params["layers_0_1"]["ffn"]["w_up"].spec == P(None, None, "tensor")
    specs = {
        s.spec
        for path, s in jax.tree_util.tree_flatten_with_path(shardings.opt_state)[0]
        if jax.tree_util.keystr(path).endswith("['layers_0_1']['attn']['q']")
    }
    assert specs == {P(None, None, None, None)}


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "mlp"))
        w = self.param("w", init, (6, 4))
        return x @ w


def test_tree_shardings_of_a_boxed_tree():
    """fsdp=4 does not divide the embed dim 6 (warned, replicated); tensor=2 divides 4."""
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    boxed = jax.eval_shape(lambda: _Two().init(jax.random.key(0), jnp.zeros((1, 6))))
    with pytest.warns(ShardingWarning, match=r"params/w: shape \[6, 4\] dim 0 .*'embed'"):
        got = sharding.tree_shardings(mesh, boxed)
    assert got["params"]["w"].spec == P(None, "tensor")
