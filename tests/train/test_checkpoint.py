import functools
import json

import jax
import numpy as np
import optax

from v41jax import config as config_lib
from v41jax.sharding import make_mesh
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.metrics import MetricsWriter, read_metrics
from v41jax.train.state import make_state_fns


def test_checkpoint_round_trip_is_bit_exact_and_keeps_last_n(tmp_path):
    cfg = config_lib.override(config_lib.get_config("tiny"), ["mesh.data=2", "mesh.fsdp=2"])
    mesh = make_mesh(cfg.mesh)
    _, optimizer, init_fn, shardings, abstract = make_state_fns(cfg, mesh)
    state = init_fn(3)

    @functools.partial(jax.jit, out_shardings=shardings)
    def step(state, key):  # real optimizer steps: Adam's two moments differ and are non-zero
        keys = iter(jax.random.split(key, len(jax.tree.leaves(state.params))))
        grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return state.replace(params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state)  # fmt: skip

    for i in range(3):
        state = step(state, jax.random.key(i))
    adam = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "nu"))
            if hasattr(x, "nu")]  # fmt: skip
    for st in adam:
        for mu, nu in zip(jax.tree.leaves(st.mu), jax.tree.leaves(st.nu), strict=True):
            assert np.abs(np.asarray(mu)).min() > 0 and not np.allclose(mu, nu)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    for step in (4, 8, 12):
        ckpt.save(step, state.replace(step=state.step + step), {"iterator": {"step": step}})
    assert ckpt.all_steps() == [8, 12] and ckpt.latest_step() == 12
    restored, extra = ckpt.restore(12, abstract)
    ckpt.close()
    assert extra == {"iterator": {"step": 12}}
    assert int(restored.step) == 12
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding  # restored straight into the sharded layout
    opt_pairs = zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(restored.opt_state), strict=True
    )
    for a, b in opt_pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(restored.rng))


def test_metrics_after_resume_point_are_moved_aside_not_lost(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        for step in range(1, 8):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
        f.write('{"step": 8, "lo')  # cut by SIGKILL mid-line
    writer = MetricsWriter(path, resume_step=4)
    writer.write({"step": 5, "loss": 5.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    with open(f"{path}.after_4") as f:
        aside = f.read().splitlines()
    assert len(aside) == 4 and json.loads(aside[0])["step"] == 5
