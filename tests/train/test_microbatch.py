"""Gradient accumulation (`train.microbatches`): one step over k microbatches equals the step
on the whole batch (params, optimizer state and metrics, to float32 tolerance), including
a batch whose microbatches hold different numbers of loss tokens; bad settings are named."""

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.sharding import make_mesh
from v41jax.train.microbatch import split_microbatches
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    b, t, v = cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    mask = np.ones((b, t), np.float32)
    mask[1, t // 2 :] = 0  # uneven token counts across microbatches
    mask[6, :5] = 0
    return {
        "inputs": rng.integers(0, v, (b, t)).astype(np.int32),
        "targets": rng.integers(0, v, (b, t)).astype(np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": mask,
    }


def _one_step(k):
    cfg = config_lib.override(
        config_lib.get_config("tiny"), [f"train.microbatches={k}", "mesh.data=2"]
    )
    mesh = make_mesh(cfg.mesh)
    model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    state, metrics = step(init_fn(0), device_batch(mesh, _batch(cfg)))
    return jax.device_get((state, metrics))


def test_accumulated_step_equals_the_full_batch_step():
    full_state, full = _one_step(1)
    for k in (2, 4):
        state, metrics = _one_step(k)
        for key in ("loss", "ce", "log_z_sq", "tokens", "grad_norm"):
            np.testing.assert_allclose(metrics[key], full[key], rtol=2e-6, err_msg=key)
        leaves = jax.tree.leaves_with_path((state.params, state.opt_state))
        for (path, a), b in zip(leaves, jax.tree.leaves((full_state.params, full_state.opt_state)),
                                strict=True):  # fmt: skip
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_microbatch_i_takes_every_kth_row():
    batch = {"x": np.arange(8)[:, None] * np.ones((8, 3))}
    micro = split_microbatches(batch, 4)["x"]
    assert micro.shape == (4, 2, 3)
    np.testing.assert_array_equal(micro[1, :, 0], [1, 5])
    with pytest.raises(ValueError, match="do not split into 3"):
        split_microbatches(batch, 3)


def test_bad_microbatch_settings_are_named():
    tiny = config_lib.get_config("tiny")
    with pytest.raises(ValueError, match="train.microbatches=3 must be >= 1 and divide"):
        config_lib.override(tiny, ["train.microbatches=3"])
    with pytest.raises(ValueError, match="not built for row-sparse tables"):
        config_lib.override(tiny, ["train.microbatches=2", "model.engram.layer_ids=1",
                                   "optim.table_optimizer=sparse_adam"])  # fmt: skip


def test_each_metric_is_combined_by_its_own_rule_whatever_its_name():
    """accumulated_grads knows no metric names: a metric called "mhc_x" that says "sum" is
    summed, one called "loss_y" that says "max" is maxed; an unwrapped value is refused."""
    import jax.numpy as jnp

    from v41jax.model.metric import Metric
    from v41jax.train.microbatch import accumulated_grads

    rows = np.asarray([[1.0], [2.0], [3.0], [4.0]], np.float32)  # microbatch i = row i (k = 4)
    mask = np.asarray([[1.0], [1.0], [1.0], [0.0]], np.float32)  # the last holds no tokens
    batch = {"x": rows, "loss_mask": mask}

    def loss_fn(w, mb):
        v = (mb["x"] * w).sum()
        return v, {
            "tokens": Metric(mb["loss_mask"].sum(), "sum"),
            "mhc_x": Metric(v, "sum"),
            "loss_y": Metric(v, "max"),
            "moe_z": Metric(v, "mean"),
            "w": Metric(v, "token_mean"),
        }

    metrics, grad = accumulated_grads(loss_fn, jnp.float32(2.0), batch, 4)
    values = rows[:, 0] * 2.0
    assert float(metrics["tokens"]) == 3.0
    np.testing.assert_allclose(metrics["mhc_x"], values.sum())
    np.testing.assert_allclose(metrics["loss_y"], values.max())
    np.testing.assert_allclose(metrics["moe_z"], values.mean())
    np.testing.assert_allclose(metrics["w"], (values * mask[:, 0]).sum() / 3.0)
    np.testing.assert_allclose(grad, (rows[:, 0] * mask[:, 0]).sum() / 3.0)

    with pytest.raises(TypeError, match="metric 'raw' is a .*not a Metric"):
        accumulated_grads(
            lambda w, mb: (w, {"tokens": Metric(mb["loss_mask"].sum(), "sum"), "raw": w}),
            jnp.float32(1.0), batch, 4,
        )  # fmt: skip
    with pytest.raises(ValueError, match="combine='median'"):
        Metric(jnp.float32(0.0), "median")
