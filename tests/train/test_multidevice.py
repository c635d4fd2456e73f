"""The same run on 1 device and on 8 fake CPU devices (data x fsdp x tensor): same losses."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from v41jax import config as config_lib
from v41jax.sharding import make_mesh
from v41jax.train import train
from v41jax.train.state import make_state_fns

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (conftest)")
BASE = ["train.steps=6", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=6"]


def _run(workdir, mesh):
    data, fsdp, tensor = mesh
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        BASE + [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"],
    )
    result = train(cfg, str(workdir), progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return np.array([r["loss"] for r in rows if "loss" in r]), result["val_loss"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), (1, 1, 1))


@pytest.mark.parametrize("mesh", [(2, 4, 1), (2, 2, 2)], ids=["data2_fsdp4", "data2_fsdp2_tp2"])
def test_eight_devices_match_one(tmp_path, one_device, mesh):
    losses1, val1 = one_device
    losses8, val8 = _run(tmp_path, mesh)
    assert len(losses1) == len(losses8) == 6
    np.testing.assert_allclose(losses8, losses1, rtol=2e-5, atol=2e-5)
    assert val8 == pytest.approx(val1, rel=2e-5)


def test_state_is_born_sharded_by_logical_axes():
    cfg = config_lib.override(
        config_lib.get_config("tiny"), ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    )
    mesh = make_mesh(cfg.mesh)
    _, _, init_fn, shardings, _ = make_state_fns(cfg, mesh)
    state = init_fn(0)
    emb = state.params["embed"]["embedding"]
    assert emb.sharding.spec == P("tensor", "fsdp")  # ("vocab", "embed")
    assert len(emb.addressable_shards) == 8 and emb.addressable_shards[0].data.shape == (256, 32)
    # Adam moments take their parameter's sharding (inside multi_transform's group states).
    specs = {
        leaf.sharding.spec
        for leaf in jax.tree.leaves(state.opt_state)
        if getattr(leaf, "shape", ()) == emb.shape
    }
    assert specs == {P("tensor", "fsdp")}
