"""optim.recipe=v41: every param gets the rule of its role (Muon for the linear maps, Q and K
per head; the Sinkhorn-balanced update for the tables, the embedding and the head; AdamW for
the rest), the Muon group is optax's Muon, and a run prints and records each group."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from v41jax import config as config_lib
from v41jax.model.param_roles import param_role
from v41jax.ops.sinkhorn_balance import SINKHORN_GAMMA, sinkhorn_balance
from v41jax.sharding import make_mesh
from v41jax.train import train
from v41jax.train.optimizer import MUON_CONSISTENT_RMS, make_optimizer, param_group_labels
from v41jax.train.resume import run_identity
from v41jax.train.state import describe_optimizer, make_state_fns, optimizer_config

EVERY_FEATURE = [
    "model.num_layers=3",
    "model.scan_layers=false",
    "model.tie_embeddings=false",
    "model.engram.layer_ids=1",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.use_short_conv=true",
    "model.mhc.n_streams=4",
    "model.moe.num_experts=4",
    "model.moe.num_shared_experts=1",
    "model.moe.layer_ids=2",
    "model.qk_norm=true",
    "model.attention_bias=true",
]


def _abstract_params(sets):
    cfg = config_lib.override(config_lib.get_config("tiny"), sets)
    return cfg, make_state_fns(cfg, make_mesh(cfg.mesh))[4].params


def test_every_param_of_every_feature_has_its_role():
    _, params = _abstract_params(EVERY_FEATURE)
    roles = {
        "/".join(p): param_role(p, x.shape) for p, x in traverse_util.flatten_dict(params).items()
    }
    want = {
        "block_0/attn/q": ("matrix", (0,), (2,)),  # [D, H, hd]: per head
        "block_0/attn/k": ("matrix", (0,), (2,)),
        "block_0/attn/v": ("matrix", (0,), (1, 2)),
        "block_0/attn/o": ("matrix", (0, 1), (2,)),
        "block_0/ffn/w_up": ("matrix", (0,), (1,)),
        "block_2/ffn/w_down": ("matrix", (1,), (2,)),  # [E, F, D]: per expert
        "block_2/ffn/router": ("matrix", (0,), (1,)),
        "block_2/ffn/shared/w_gate": ("matrix", (0,), (1,)),
        "block_1/engram/w_k": ("matrix", (0,), (2,)),  # [in, branches, out]: per branch
        "block_1/engram/w_v": ("matrix", (0,), (1,)),
        "block_0/attn_mix/phi": ("matrix", (0,), (1,)),
        "embed/embedding": ("embedding", (), ()),
        "head": ("head", (), ()),
        "block_1/engram/table": ("table", (), ()),
        "block_0/attn/q_bias": ("vector", (), ()),
        "block_0/attn/k_norm/scale": ("vector", (), ()),
        "block_0/attn_mix/alpha": ("vector", (), ()),
        "block_1/engram/key_norm": ("vector", (), ()),
        "block_1/engram/b_k": ("vector", (), ()),
        "block_1/engram/conv_kernel": ("other", (), ()),
    }
    for path, (role, ins, outs) in want.items():
        got = roles[path]
        assert (got.role, got.in_axes, got.out_axes) == (role, ins, outs), path
    assert roles["head"].rows_axis == 1 and roles["embed/embedding"].rows_axis == 0
    others = sorted(p for p, r in roles.items() if r.role == "other")
    assert others == ["block_1/engram/conv_kernel"], others  # nothing else falls through
    # a scanned stack: the layer axis leads, each layer its own matrix
    _, scanned = _abstract_params(["model.scan_layers=true", "model.num_layers=4"])
    q = scanned["layers_0_3"]["attn"]["q"]
    role = param_role(("layers_0_3", "attn", "q"), q.shape)
    assert q.ndim == 4 and (role.in_axes, role.out_axes) == ((1,), (3,))
    with pytest.raises(ValueError, match=r"attn/q has shape \(64,\): too few axes"):
        param_role(("attn", "q"), (64,))


def test_the_recipe_groups_and_configured_groups_first():
    cfg, params = _abstract_params([*EVERY_FEATURE, "optim.recipe=v41"])
    optim = optimizer_config(cfg)
    labels = traverse_util.flatten_dict(
        param_group_labels(params, optim.param_groups, optim.recipe)
    )
    by = {"/".join(p): n for p, n in labels.items()}
    assert by["block_0/attn/q"] == by["block_2/ffn/w_down"] == "v41_muon"
    assert by["embed/embedding"] == "v41_embedding" and by["head"] == "v41_head"
    assert by["block_1/engram/table"] == "engram_tables"  # the feature's group, sinkhorn
    assert by["block_0/attn_norm/scale"] == "no_decay"  # the configured group matches first
    assert by["block_1/engram/key_norm"] == "v41_vectors"
    assert by["block_1/engram/conv_kernel"] == "default"
    rows = {r["group"]: r for r in describe_optimizer(cfg, params)}
    assert rows["engram_tables"]["rule"] == "sinkhorn"  # "adam" reads as the recipe's
    assert rows["v41_muon"]["rule"] == "muon" and rows["v41_muon"]["peak_lr"] == cfg.optim.lr
    assert rows["v41_head"]["peak_lr"] == pytest.approx(cfg.optim.lr * SINKHORN_GAMMA)
    assert rows["v41_vectors"]["weight_decay"] == 0.0
    assert sum(r["params"] for r in rows.values()) == sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(params)
    )
    # under the default recipe the same params are all AdamW
    cfg, params = _abstract_params(EVERY_FEATURE)
    assert {r["rule"] for r in describe_optimizer(cfg, params)} == {"adamw"}


def _one_update(optim_cfg, params, grads, steps=1):
    opt = make_optimizer(optim_cfg, 100, params)
    state = opt.init(params)
    for _ in range(steps):
        updates, state = opt.update(grads, state, params)
    return updates


def test_the_muon_group_is_optax_muon_per_matrix_and_per_head():
    """A q kernel [D, H, hd] moves as optax.contrib.muon moves each head's [D, hd] matrix
    alone (consistent_rms 0.2, no decay); an FFN matrix as optax's on the whole matrix."""
    optim = config_lib.OptimConfig(recipe="v41", warmup_steps=0, weight_decay=0.0, grad_clip=0)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(24, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(24, 40)), jnp.float32)
    params = {"attn": {"q": q}, "ffn": {"w_up": w}}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    ours = _one_update(optim, params, grads, steps=2)

    def optax_muon(p, g):
        opt = optax.contrib.muon(
            optax.warmup_cosine_decay_schedule(0.0, optim.lr, 0, 100, optim.lr * 0.1),
            consistent_rms=MUON_CONSISTENT_RMS,
        )
        state = opt.init(p)
        for _ in range(2):
            u, state = opt.update(g, state, p)
        return u

    np.testing.assert_allclose(ours["ffn"]["w_up"], optax_muon(w, grads["ffn"]["w_up"]),
                               rtol=2e-5, atol=1e-7)  # fmt: skip
    for h in range(3):
        ref = optax_muon(q[:, h], grads["attn"]["q"][:, h])
        np.testing.assert_allclose(ours["attn"]["q"][:, h], ref, rtol=2e-5, atol=1e-7)
    # negative control: the whole [D, H hd] matrix at once is not the per-head update
    whole = optax_muon(q.reshape(24, 24), grads["attn"]["q"].reshape(24, 24)).reshape(q.shape)
    assert not np.allclose(ours["attn"]["q"], whole, rtol=1e-2)


def test_the_head_is_balanced_over_its_token_columns():
    """The head [D, V] moves by -lr gamma sinkhorn_balance(N^T)^T: its rows are the tokens;
    the embedding [V, D] by -lr gamma sinkhorn_balance(N) (Nesterov N = g + mu g at step 1)."""
    optim = config_lib.OptimConfig(recipe="v41", warmup_steps=0, grad_clip=0)
    rng = np.random.default_rng(1)
    head = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    emb = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
    params = {"head": head, "embed": {"embedding": emb}}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    # token 7 barely seen: under tau x the mean row norm, so its row (the head's column) is
    # masked; balanced the wrong way round it would be a feature column and move
    grads["head"] = grads["head"].at[:, 7].multiply(1e-5)
    ours = _one_update(optim, params, grads)
    lr = optim.lr * SINKHORN_GAMMA
    n_head, n_emb = 1.95 * grads["head"], 1.95 * grads["embed"]["embedding"]
    np.testing.assert_allclose(ours["head"], -lr * sinkhorn_balance(n_head.T).T, rtol=1e-5)
    np.testing.assert_allclose(ours["embed"]["embedding"], -lr * sinkhorn_balance(n_emb),
                               rtol=1e-5)  # fmt: skip
    assert np.all(ours["head"][:, 7] == 0)
    assert np.all(sinkhorn_balance(n_head)[:, 7] != 0)  # the wrong orientation moves it


def test_a_v41_run_trains_and_records_its_groups(tmp_path, capsys):
    sets = [
        "optim.recipe=v41",
        "model.num_layers=2",
        "model.engram.layer_ids=1",
        "model.engram.engram_vocab_size=1000,1000",
        "model.engram.n_embed_per_ngram=32",
        "model.engram.n_head_per_ngram=2",
        "optim.table_optimizer=sinkhorn_sparse",
        "train.steps=30",
        "train.eval_every=0",
        "train.log_every=1",
        "train.checkpoint_every=30",
    ]
    cfg = config_lib.override(config_lib.get_config("tiny"), sets)
    workdir = str(tmp_path / "v41")
    train(cfg, workdir, progress=False)
    out = capsys.readouterr().out
    assert "optimizer group v41_muon: muon, peak lr 0.003" in out, out
    assert "optimizer group engram_tables: sinkhorn_sparse (row-sparse, device tables)" in out
    with open(os.path.join(workdir, "optimizer.json")) as f:
        record = json.load(f)
    assert record["recipe"] == "v41"
    assert {g["group"] for g in record["groups"]} >= {"v41_muon", "v41_embedding", "no_decay"}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert len(losses) == 30 and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


def test_recipe_errors_name_the_value():
    base = config_lib.get_config("tiny")
    with pytest.raises(ValueError, match=r"optim.recipe='muon' not in \('adamw', 'v41'\)"):
        config_lib.override(base, ["optim.recipe=muon"])
    groups = (config_lib.ParamGroup("v41_muon", "ffn"),)
    with pytest.raises(ValueError, match=r"\['v41_muon'\] are the v41 recipe's own"):
        param_group_labels({"ffn": jnp.zeros((2, 2))}, groups, "v41")
    on = config_lib.override(base, ["optim.recipe=v41"])
    assert run_identity(on) != run_identity(base)
