"""A checkpoint written with one layer layout (one "block_i" per layer, as before layers were
scanned) restores into the other (scanned "layers_a_b" runs) and back: params and Adam
moments are stacked / sliced, step and RNG kept, leaves placed in the target shardings."""

import jax
import numpy as np

from v41jax import config as config_lib
from v41jax.model import unscan_tree
from v41jax.sharding import make_mesh
from v41jax.train.checkpoint import Checkpointer
from v41jax.train.state import make_state_fns


def _fns(scan: bool):
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        ["mesh.data=2", "mesh.fsdp=2", f"model.scan_layers={str(scan).lower()}"],
    )
    return cfg, make_state_fns(cfg, make_mesh(cfg.mesh))


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checkpoint_restores_across_layer_layouts(tmp_path):
    cfg, (_, _, init_flat, _, abstract_flat) = _fns(False)
    _, (_, _, _, _, abstract_scanned) = _fns(True)
    state = init_flat(3)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    ckpt.save(5, state.replace(step=state.step + 5), {"iterator": {"step": 5}})
    ckpt.close()  # a fresh manager (a later process) must read the saved layout
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    scanned, extra = ckpt.restore(5, abstract_scanned)
    assert extra == {"iterator": {"step": 5}} and int(scanned.step) == 5
    assert "block_0" not in scanned.params and any(k.startswith("layers_") for k in scanned.params)
    assert jax.tree.structure(scanned) == jax.tree.structure(abstract_scanned)
    for got, want in zip(jax.tree.leaves(scanned), jax.tree.leaves(abstract_scanned), strict=True):
        assert got.shape == want.shape and got.sharding == want.sharding
    n = cfg.model.num_layers
    _assert_same(unscan_tree(scanned.params, n), state.params)
    _assert_same(unscan_tree(scanned.opt_state, n), state.opt_state)
    np.testing.assert_array_equal(np.asarray(scanned.rng), np.asarray(state.rng))
    # ...and a scanned checkpoint restores into the unscanned layout
    ckpt.save(6, scanned.replace(step=scanned.step + 1), {"iterator": {"step": 6}})
    flat, _ = ckpt.restore(6, abstract_flat)
    ckpt.close()
    _assert_same(flat.params, state.params)
    _assert_same(flat.opt_state, state.opt_state)
