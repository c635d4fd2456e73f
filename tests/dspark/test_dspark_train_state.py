"""The drafter's train state is the training stack's: its optimizer and schedule, and
shardings read from the logical annotations, on the target's mesh (8 fake CPU devices)."""

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax import sharding
from v41jax.config import MeshConfig
from v41jax.dspark.model.drafter import frozen_target
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.dspark.train.state import drafter_optimizer, drafter_state_fns
from v41jax.dspark.train.step import init_drafter_params
from v41jax.train.optimizer import lr_schedule
from v41jax.train.state import make_state_fns

SETTINGS = ["drafter.num_layers=1", "drafter.block_size=3", "drafter.markov_rank=4",
            "train.steps=40", "train.warmup_steps=5", "train.lr=1e-3"]  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    tcfg = config_lib.override(config_lib.get_config("tiny"), ["model.max_seq_len=64"])
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    target = make_state_fns(tcfg, mesh)[2](0).params
    cfg = config_lib.override(DrafterRunConfig(), SETTINGS)
    return cfg, tcfg.model, frozen_target(target, tcfg.model), mesh


def test_the_state_is_born_in_the_shardings_of_its_annotations(setup):
    cfg, tcfg, frozen, mesh = setup
    _, new_state, shardings, abstract = drafter_state_fns(cfg, tcfg, frozen, mesh)
    state = new_state(init_drafter_params(cfg, tcfg, frozen, 0))
    got = jax.tree.map(lambda x: x.sharding, state)
    assert jax.tree.all(jax.tree.map(lambda a, b: a == b, got, shardings))
    assert jax.tree.all(jax.tree.map(lambda x, a: x.sharding == a.sharding, state, abstract))
    # ctx_proj [F, D] is (None, "embed"): D over fsdp; Adam's moments follow their param
    spec = state["params"]["ctx_proj"].sharding.spec
    assert tuple(spec) in ((None, "fsdp"),), spec
    adam = state["opt_state"][1].inner_states["default"].inner_state[0]
    assert adam.mu["ctx_proj"].sharding == state["params"]["ctx_proj"].sharding
    assert adam.nu["ctx_proj"].sharding == state["params"]["ctx_proj"].sharding
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(got))


def test_the_optimizer_is_the_training_stacks_with_the_drafters_schedule(setup):
    """The drafter's AdamW steps by the stack's schedule (warmup, then a cosine to 0.1 x lr
    over train.steps): with a constant gradient Adam's normalised step is 1 per coordinate, so
    the 8th update is lr(7) everywhere."""
    cfg, tcfg, frozen, _ = setup
    params = init_drafter_params(cfg, tcfg, frozen, 0)
    opt = drafter_optimizer(cfg, params)
    sched = lr_schedule(cfg.train.optim, cfg.train.loop.steps)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(1e-3)
    assert float(sched(40)) == pytest.approx(1e-4)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: np.full(p.shape, 1e-3, np.float32), params)
    for _ in range(8):
        updates, state = opt.update(grads, state, params)
    # Adam with a constant gradient: the normalised step is ~1, so |update| = lr(7)
    u = np.abs(np.asarray(updates["ctx_proj"]))
    np.testing.assert_allclose(u, float(sched(7)), rtol=1e-3)
