import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from v41jax.config import OptimConfig, ParamGroup
from v41jax.train import lr_schedule, make_optimizer, next_token_loss, param_group_labels

PARAMS = {
    "embed": {"embedding": jnp.ones((4, 3))},
    "block_0": {"norm": {"scale": jnp.ones((3,))}, "mlp": {"w_up": jnp.ones((3, 5))}},
    "engram": {"table": jnp.ones((7, 3))},
}


def test_param_group_labels_first_match_wins():
    groups = (
        ParamGroup("tables", r"engram/table$", lr_scale=5.0, weight_decay=0.0),
        ParamGroup("no_decay", r"scale$", weight_decay=0.0),
    )
    labels = param_group_labels(PARAMS, groups)
    assert labels["engram"]["table"] == "tables"
    assert labels["block_0"]["norm"]["scale"] == "no_decay"
    assert labels["block_0"]["mlp"]["w_up"] == "default"
    with pytest.raises(ValueError, match="unique"):
        param_group_labels(PARAMS, (ParamGroup("a", "x"), ParamGroup("a", "y")))


def test_group_lr_scale_and_weight_decay():
    cfg = OptimConfig(
        lr=1e-2,
        warmup_steps=0,
        weight_decay=0.5,
        grad_clip=0.0,
        param_groups=(ParamGroup("tables", r"table$", lr_scale=5.0, weight_decay=0.0),),
    )
    opt = make_optimizer(cfg, 100, PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = opt.update(grads, opt.init(PARAMS), PARAMS)
    # Adam's first step is -lr * sign(g) (+ decay * p for decayed groups).
    np.testing.assert_allclose(updates["engram"]["table"], -5e-2, rtol=1e-5)
    np.testing.assert_allclose(updates["block_0"]["mlp"]["w_up"], -1e-2 * (1 + 0.5), rtol=1e-5)


def test_global_norm_clipping_spans_all_groups():
    cfg = OptimConfig(
        lr=1.0,
        warmup_steps=0,
        grad_clip=1.0,
        weight_decay=0.0,
        param_groups=(ParamGroup("tables", r"table$"),),
    )
    opt = make_optimizer(cfg, 10, PARAMS)
    # the groups' gradients have very different norms (tables x 100): per-group clipping
    # would scale each group to norm 1; the global rule scales all by one factor
    big = {**jax.tree.map(lambda p: 3.0 * jnp.ones_like(p), PARAMS),
           "engram": {"table": 300.0 * jnp.ones((7, 3))}}  # fmt: skip
    _, state = opt.update(big, opt.init(PARAMS), PARAMS)
    factor = 1.0 / float(optax.tree.norm(big))
    mu = {}  # Adam's first moment after one step: (1 - b1) * clipped gradient, per leaf
    for st in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)):
        if isinstance(st, optax.ScaleByAdamState):
            mu.update({jax.tree_util.keystr(k): v for k, v in jax.tree.leaves_with_path(st.mu)})
    want = {jax.tree_util.keystr(k): (1 - cfg.b1) * g * factor
            for k, g in jax.tree.leaves_with_path(big)}  # fmt: skip
    assert sorted(mu) == sorted(want)  # every param in exactly one group
    for k, v in want.items():
        np.testing.assert_allclose(mu[k], v, rtol=1e-5, err_msg=k)


def test_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    sched = lr_schedule(cfg, 110)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(0.5)
    assert float(sched(10)) == pytest.approx(1.0)
    assert float(sched(60)) == pytest.approx(0.55, rel=1e-4)
    assert float(sched(110)) == pytest.approx(0.1, rel=1e-4)


def test_next_token_loss_matches_hand_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    targets = rng.integers(0, 5, (2, 3)).astype(np.int32)
    mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
    lse = np.log(np.exp(logits).sum(-1))
    ce = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want = (ce * mask).sum() / mask.sum() + 0.1 * (lse**2 * mask).sum() / mask.sum()
    loss, metrics = next_token_loss(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), 0.1
    )
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(metrics["tokens"]) == 4


def test_a_sinkhorn_group_is_balanced_momentum_at_lr_times_gamma():
    """The Engram table group with rule "sinkhorn" (optim.table_optimizer=sinkhorn): Nesterov
    momentum, the Sinkhorn balance, -lr x lr_scale x gamma; the other groups stay AdamW, and
    the group's state is one buffer of the table's size."""
    from v41jax.config import get_config, override
    from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balance
    from v41jax.train.state import optimizer_config

    cfg = override(
        get_config("tiny"), ["model.engram.layer_ids=1", "optim.table_optimizer=sinkhorn"]
    )
    (group,) = [g for g in optimizer_config(cfg).param_groups if g.name == "engram_tables"]
    assert group.rule == "sinkhorn" and group.momentum == cfg.model.engram.table_momentum
    ocfg = OptimConfig(
        lr=1e-2,
        warmup_steps=0,
        grad_clip=0.0,
        param_groups=(ParamGroup("tables", r"table$", lr_scale=5.0, weight_decay=0.0,
                                 rule="sinkhorn", momentum=0.9),),
    )  # fmt: skip
    opt = make_optimizer(ocfg, 100, PARAMS)
    state = opt.init(PARAMS)
    rng = np.random.default_rng(0)
    trace = np.zeros((7, 3))
    for step in range(2):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
        updates, state = opt.update(g, state, PARAMS)
        trace = 0.9 * trace + np.asarray(g["engram"]["table"])
        nesterov = np.asarray(g["engram"]["table"]) + 0.9 * trace
        lr = float(lr_schedule(ocfg, 100, 5.0 * SINKHORN_GAMMA)(step))
        want = -lr * np.asarray(sinkhorn_balance(jnp.asarray(nesterov, jnp.float32)))
        np.testing.assert_allclose(updates["engram"]["table"], want, rtol=1e-5, atol=1e-7)
