"""DSpark drafter and Markov head: shapes, attention visibility, frozen target, the exact
draft distribution q, a G-test of the sampled joint law, and input validation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util
from scipy import stats

from v41jax.config import ModelConfig
from v41jax.decode.sampling import SamplingParams, sampling_probs
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import (
    Drafter,
    DrafterOutput,
    FrozenTarget,
    draft_confidence,
    frozen_target,
    previous_tokens,
)
from v41jax.dspark.model.markov import markov_bias, markov_draft, teacher_forced_logits
from v41jax.model.transformer import init_params

V, D = 301, 32
TARGET = ModelConfig(
    vocab_size=V, d_model=D, num_layers=3, num_heads=2, num_kv_heads=2, d_ff=48, max_seq_len=64
)
F = 3 * D  # default layer_ids: the target's last 3 layers
# init_std 0.2 so that a change in one visible context slot is far above float noise
MASK_CFG = DrafterConfig(
    block_size=3, num_layers=2, num_heads=2, window=4, markov_rank=4, init_std=0.2
)


@functools.lru_cache(maxsize=1)
def _frozen() -> FrozenTarget:
    # rbg keys: the same init, compiled ~3x faster than threefry on CPU
    return frozen_target(init_params(TARGET, jax.random.key(0, impl="rbg")), TARGET)


def _inputs(b, s, n, seed=0):
    rng = np.random.default_rng(seed)
    feats = jnp.asarray(rng.normal(size=(b, s, F)), jnp.float32)
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = jnp.ones((b, s), bool)
    anchors = jnp.asarray(rng.integers(0, V, size=(b, n)), jnp.int32)
    anchor_pos = jnp.asarray(rng.integers(1, s + 1, size=(b, n)), jnp.int32)
    return feats, ctx_pos, valid, anchors, anchor_pos


def _flat(tree):
    return traverse_util.flatten_dict(nn.unbox(tree), sep="/")


@pytest.mark.parametrize("kind,markov_rank", [("dspark", 4), ("parallel", 0)])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("n,s", [(1, 5), (3, 9)])
def test_shapes_dtypes_and_param_tree(kind, markov_rank, k, n, s):
    cfg = DrafterConfig(
        kind=kind, block_size=k, num_layers=2, num_heads=2, window=4, markov_rank=markov_rank
    )
    model, args = Drafter(cfg, TARGET), (_frozen(), *_inputs(2, s, n))
    # abstract evaluation: shapes and dtypes of every combination without compiling
    params = jax.eval_shape(model.init, jax.random.key(0), *args)
    out = jax.eval_shape(model.apply, params, *args)
    assert isinstance(out, DrafterOutput)
    assert out.base_logits.shape == (2, n, k, V) and out.base_logits.dtype == jnp.float32
    assert out.hidden.shape == (2, n, k, D)
    assert out.confidence_logits.shape == (2, n, k)
    assert out.confidence_logits.dtype == jnp.float32
    flat = _flat(params["params"])
    assert all(x.size < V * D for x in flat.values()), "the drafter must not own a [V, D] table"
    assert flat["ctx_proj"].shape == (F, D) and flat["mask_embedding"].shape == (D,)
    assert {"confidence/kernel", "confidence/bias", "final_norm/scale", "ctx_norm/scale"} <= set(
        flat
    )
    assert {p.split("/")[0] for p in flat if p.startswith("block_")} == {"block_0", "block_1"}
    if cfg.uses_markov:
        assert flat["markov/u"].shape == flat["markov/w"].shape == (V, markov_rank)
    else:
        assert not any(p.startswith("markov") for p in flat)


def test_frozen_target_tied_and_untied():
    fz = _frozen()
    assert fz.embedding.shape == (V, D) and fz.head.shape == (D, V)
    np.testing.assert_array_equal(fz.head, fz.embedding.T)
    e, h = jnp.ones((V, D)), jnp.full((D, V), 2.0)
    untied_cfg = dataclasses.replace(TARGET, tie_embeddings=False)
    untied = frozen_target({"params": {"embed": {"embedding": e}, "head": h}}, untied_cfg)
    np.testing.assert_array_equal(untied.head, h)


# ----------------------------------------------------------------------------- masking


@functools.lru_cache(maxsize=1)
def _mask_setup():
    """Row 0: 11 slots at positions 0..10, slot 3 invalid, slot 2 in another segment; block
    anchors at 6, 8, 10. Block 0 (window 4) sees exactly slots 4 and 5."""
    b, s, n = 2, 11, 3
    feats, ctx_pos, valid, anchors, _ = _inputs(b, s, n, seed=1)
    valid = valid.at[0, 3].set(False)
    ctx_seg = jnp.zeros((b, s), jnp.int32).at[0, 2].set(1)
    anchor_seg = jnp.zeros((b, n), jnp.int32)
    anchor_pos = jnp.array([[6, 8, 10], [4, 7, 11]], jnp.int32)
    model = Drafter(MASK_CFG, TARGET)
    base = (_frozen(), feats, ctx_pos, valid, anchors, anchor_pos, ctx_seg, anchor_seg)
    params = jax.jit(model.init)(jax.random.key(3), *base)
    return model, params, base, jax.jit(model.apply)


def _block0(out):
    return [np.asarray(x[0, 0]) for x in out]


def _run(change_slot=None, anchors=None, segments=True):
    model, params, base, apply = _mask_setup()
    fz, feats, ctx_pos, valid, anc, apos, cseg, aseg = base
    if change_slot is not None:
        feats = feats.at[0, change_slot].set(jnp.linspace(-3.0, 5.0, F))
    if anchors is not None:
        anc = anchors
    if not segments:
        cseg = aseg = None
    return apply(params, fz, feats, ctx_pos, valid, anc, apos, cseg, aseg)


@pytest.mark.parametrize(
    "slot,why",
    [
        (6, "at anchor_pos"),
        (9, "after anchor"),
        (1, "before window"),
        (3, "invalid"),
        (2, "other segment"),
    ],
)
def test_invisible_context_slots_do_not_change_block(slot, why):
    ref, new = _run(), _run(change_slot=slot)
    for a, b in zip(_block0(ref), _block0(new), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=why)
    for a, b in zip(ref, new, strict=True):  # other rows never see row 0's context
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])


def _changes(a_list, b_list):
    return min(np.max(np.abs(a - b)) for a, b in zip(a_list, b_list, strict=True))


def test_visible_context_slot_changes_block():
    for slot in (4, 5):
        assert _changes(_block0(_run()), _block0(_run(change_slot=slot))) > 1e-4
    # without segment ids slot 2 is in the window and valid, so it becomes visible
    ref = _run(segments=False)
    assert _changes(_block0(ref), _block0(_run(change_slot=2, segments=False))) > 1e-4


def test_blocks_do_not_see_each_other():
    _, _, base, _ = _mask_setup()
    anchors = base[4].at[0, 1].set((base[4][0, 1] + 7) % V)
    ref, new = _run(), _run(anchors=anchors)
    for a, b in zip(_block0(ref), _block0(new), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.max(np.abs(np.asarray(ref.base_logits[0, 1] - new.base_logits[0, 1]))) > 1e-4


def test_context_kv_is_per_position():
    model, params, base, _ = _mask_setup()
    feats, ctx_pos = base[1], base[2]
    kv_fn = jax.jit(functools.partial(model.apply, method=Drafter.context_kv))
    ref = kv_fn(params, feats, ctx_pos)
    new = kv_fn(params, feats.at[0, 4].set(jnp.linspace(-3.0, 5.0, F)), ctx_pos)
    assert len(ref) == MASK_CFG.num_layers
    for layer_ref, layer_new in zip(ref, new, strict=True):
        for name in ("k", "v"):
            diff = np.abs(np.asarray(layer_ref[name] - layer_new[name])).max(axis=(2, 3))
            assert layer_ref[name].shape == (2, 11, 2, D // 2)
            assert diff[0, 4] > 1e-4
            diff[0, 4] = 0.0
            assert not diff.any()


# ----------------------------------------------------------------------------- frozen target


def test_gradients_reach_drafter_only():
    cfg = DrafterConfig(block_size=7, num_layers=1, num_heads=2, markov_rank=4)
    model = Drafter(cfg, TARGET)
    tparams = init_params(TARGET, jax.random.key(0, impl="rbg"))
    feats, ctx_pos, valid, anchors, apos = _inputs(2, 7, 2, seed=2)
    nxt = jnp.asarray(np.random.default_rng(3).integers(0, V, size=(2, 2, 7)), jnp.int32)
    args = (feats, ctx_pos, valid, anchors, apos)
    dparams = jax.jit(model.init)(jax.random.key(1), _frozen(), *args)["params"]

    def loss(dp, frozen):
        out = model.apply({"params": dp}, frozen, *args)
        logits = teacher_forced_logits(out.base_logits, nn.unbox(dp["markov"]), anchors, nxt)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[..., None], -1).mean()
        bce = _bce(out.confidence_logits, 0.7)
        return ce + bce + jnp.mean(out.hidden**2)

    def loss_target(dp, tp):
        return loss(dp, frozen_target(tp, TARGET))

    out = jax.jit(model.apply)({"params": dparams}, _frozen(), *args)
    assert all(np.isfinite(np.asarray(x)).all() for x in out)
    g_d, g_t = jax.jit(jax.grad(loss_target, argnums=(0, 1)))(dparams, tparams)
    for path, g in _flat(g_d).items():
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(nn.unbox(g_t)))
    # a FrozenTarget built without frozen_target gets no gradient either
    g_f = jax.jit(jax.grad(loss, argnums=1))(dparams, FrozenTarget(*map(jnp.array, _frozen())))
    assert not np.asarray(g_f.embedding).any() and not np.asarray(g_f.head).any()


def _bce(logits, target):
    return jnp.mean(jax.nn.softplus(logits) - target * logits)


# ----------------------------------------------------------------------------- Markov head


def _markov(v, r, scale, seed):
    rng = np.random.default_rng(seed)
    return {
        "u": jnp.asarray(scale * rng.normal(size=(v, r)), jnp.float32),
        "w": jnp.asarray(scale * rng.normal(size=(v, r)), jnp.float32),
    }


def test_teacher_forced_logits_by_hand():
    v, r = 11, 3
    rng = np.random.default_rng(0)
    base = rng.normal(size=(2, 3, 4, v)).astype(np.float32)
    anchors = rng.integers(0, v, size=(2, 3))
    nxt = rng.integers(0, v, size=(2, 3, 4))
    mp = _markov(v, r, 1.0, 1)
    np.testing.assert_array_equal(teacher_forced_logits(base, None, anchors, nxt), base)
    got = np.asarray(teacher_forced_logits(base, mp, anchors, nxt))
    u, w = np.asarray(mp["u"], np.float64), np.asarray(mp["w"], np.float64)
    prev = np.concatenate([anchors[..., None], nxt[..., :-1]], axis=-1)
    np.testing.assert_allclose(got, base + u[prev] @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(markov_bias(mp, prev), u[prev] @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_markov", [True, False])
def test_markov_draft_q_is_the_sampled_law(with_markov):
    b, k, v = 64, 4, 11
    base = jnp.asarray(np.random.default_rng(0).normal(size=(b, k, v)), jnp.float32)
    anchors = jnp.arange(b, dtype=jnp.int32) % v
    mp = _markov(v, 3, 1.0, 1) if with_markov else None
    probs_fn = functools.partial(sampling_probs, sampling=SamplingParams(temperature=0.7, top_k=4))
    drafts, q = jax.jit(markov_draft, static_argnums=4)(
        jax.random.key(5), base, anchors, mp, probs_fn
    )
    assert drafts.shape == (b, k) and drafts.dtype == jnp.int32
    assert q.shape == (b, k, v) and q.dtype == jnp.float32
    re = probs_fn(teacher_forced_logits(base[:, None], mp, anchors[:, None], drafts[:, None]))
    np.testing.assert_allclose(q, re[:, 0], rtol=0, atol=1e-6)
    assert (np.take_along_axis(np.asarray(q), np.asarray(drafts)[..., None], -1) > 0).all()
    assert (np.asarray(q) > 0).sum(-1).max() <= 4  # top_k acted


def test_markov_draft_greedy_is_argmax_chain():
    b, k, v = 8, 5, 13
    base = np.random.default_rng(2).normal(size=(b, k, v)).astype(np.float32)
    anchors = np.arange(b) % v
    mp = _markov(v, 2, 1.5, 3)
    probs_fn = functools.partial(sampling_probs, sampling=SamplingParams(0.0))
    drafts, q = markov_draft(
        jax.random.key(0), jnp.asarray(base), jnp.asarray(anchors), mp, probs_fn
    )
    u, w = np.asarray(mp["u"]), np.asarray(mp["w"])
    prev, want = anchors, []
    for i in range(k):
        prev = np.argmax(base[:, i] + u[prev] @ w.T, axis=-1)
        want.append(prev)
    np.testing.assert_array_equal(drafts, np.stack(want, axis=1))
    np.testing.assert_array_equal(q.max(-1), 1.0)


def test_markov_draft_joint_law_g_test():
    """20000 rows, V = 5, K = 2: the empirical joint of (x_1, x_2) matches
    q_1(x_1) q_2(x_2 | x_1); the same samples reject the law without the Markov term."""
    rows, v = 20000, 5
    rng = np.random.default_rng(0)
    base_kv = rng.normal(size=(2, v)).astype(np.float32)
    mp = _markov(v, 2, 0.8, 4)
    anchor = 2
    base = jnp.broadcast_to(jnp.asarray(base_kv), (rows, 2, v))
    probs_fn = functools.partial(sampling_probs, sampling=SamplingParams(1.0))
    drafts, _ = jax.jit(markov_draft, static_argnums=4)(
        jax.random.key(11), base, jnp.full((rows,), anchor, jnp.int32), mp, probs_fn
    )
    obs = np.bincount(np.asarray(drafts[:, 0]) * v + np.asarray(drafts[:, 1]), minlength=v * v)

    def softmax(z):
        z = np.asarray(z, np.float64)
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    u, w = np.asarray(mp["u"], np.float64), np.asarray(mp["w"], np.float64)
    q1 = softmax(base_kv[0] + u[anchor] @ w.T)
    q2 = softmax(base_kv[1][None] + u @ w.T)  # row x_1: q_2(. | x_1)
    expected = rows * (q1[:, None] * q2).ravel()
    assert expected.min() > 5, "G-test needs >= 5 expected counts per cell"
    p = stats.power_divergence(obs, expected, lambda_="log-likelihood").pvalue
    assert p > 1e-3, p
    no_markov = rows * np.outer(softmax(base_kv[0]), softmax(base_kv[1])).ravel()
    p0 = stats.power_divergence(obs, no_markov, lambda_="log-likelihood").pvalue
    assert p0 < 1e-6, p0


# ----------------------------------------------------------------------------- validation


def test_bad_inputs_raise():
    model, params, base, _ = _mask_setup()
    fz, feats, ctx_pos, valid, anchors, apos, _, _ = base
    with pytest.raises(ValueError, match="feats shape .*96"):
        model.apply(params, feats[..., :-1], ctx_pos, method=Drafter.context_kv)
    for bad in (V, -1):
        with pytest.raises(ValueError, match=f"anchors.*\\[0, {V}\\)"):
            model.apply(params, fz, feats, ctx_pos, valid, anchors.at[0, 0].set(bad), apos)
    with pytest.raises(ValueError, match="anchor_pos"):
        model.apply(params, fz, feats, ctx_pos, valid, anchors, apos[:, :2])
    with pytest.raises(ValueError, match="together"):
        model.apply(params, fz, feats, ctx_pos, valid, anchors, apos, base[6], None)
    with pytest.raises(ValueError, match="next_tokens"):
        teacher_forced_logits(
            jnp.zeros((1, 1, 2, 5)),
            _markov(5, 2, 1.0, 0),
            jnp.zeros((1, 1), jnp.int32),
            jnp.full((1, 1, 2), 5),
        )


# ----------------------------------------------------------------------------- confidence heads


def test_draft_confidence_of_both_heads():
    """ "hidden": bitwise sigmoid(confidence_logits), its param tree unchanged; "prev_token":
    sigmoid(hidden part + u(x_{k-1}) . w_p) by hand, w_p = 0 at init (the hidden head), and
    the confidence loss trains w_p but not the Markov table u (stop_gradient)."""
    args = (_frozen(), *_inputs(2, 9, 3, seed=4))
    prev_cfg = dataclasses.replace(MASK_CFG, confidence_input="prev_token")
    hid_model, prev_model = Drafter(MASK_CFG, TARGET), Drafter(prev_cfg, TARGET)
    hid = hid_model.init(jax.random.key(0), *args)["params"]
    prev = prev_model.init(jax.random.key(0), *args)["params"]
    assert set(_flat(prev)) == set(_flat(hid)) | {"confidence_prev"}
    assert _flat(prev)["confidence_prev"].shape == (MASK_CFG.markov_rank,)
    rng = np.random.default_rng(5)
    drafts = jnp.asarray(rng.integers(0, V, size=(2, 3, 3)), jnp.int32)
    tokens = previous_tokens(args[4], drafts)
    np.testing.assert_array_equal(np.asarray(tokens[..., 0]), np.asarray(args[4]))
    np.testing.assert_array_equal(np.asarray(tokens[..., 1:]), np.asarray(drafts[..., :-1]))
    out = hid_model.apply({"params": hid}, *args)
    got = draft_confidence(hid, MASK_CFG, out, jnp.zeros_like(tokens))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(jax.nn.sigmoid(out.confidence_logits))
    )
    out_p = prev_model.apply({"params": prev}, *args)
    np.testing.assert_array_equal(
        np.asarray(out_p.confidence_logits), np.asarray(out.confidence_logits)
    )
    np.testing.assert_allclose(draft_confidence(prev, prev_cfg, out_p, tokens), got, rtol=1e-6)
    w_p = rng.normal(size=MASK_CFG.markov_rank).astype(np.float32)
    prev = {**nn.unbox(prev), "confidence_prev": jnp.asarray(w_p)}
    u = np.asarray(nn.unbox(prev["markov"]["u"]), np.float64)
    logit = np.asarray(out_p.confidence_logits, np.float64) + u[np.asarray(tokens)] @ w_p
    got = draft_confidence(prev, prev_cfg, out_p, tokens)
    np.testing.assert_allclose(np.asarray(got), 1 / (1 + np.exp(-logit)), rtol=1e-5)
    grads = jax.grad(lambda dp: jnp.sum(draft_confidence(dp, prev_cfg, out_p, tokens)))(prev)
    assert not np.asarray(grads["markov"]["u"]).any()
    assert np.abs(np.asarray(grads["confidence_prev"])).max() > 0
    with pytest.raises(ValueError, match="prev_tokens has shape"):
        draft_confidence(prev, prev_cfg, out_p, tokens[..., :2])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(confidence_input="sampled"), "'sampled'"),
        (dict(confidence_input="prev_token", markov_rank=0), "markov_rank=0"),
        (dict(confidence_input="prev_token", kind="parallel", markov_rank=0), "'parallel'"),
    ],
)
def test_confidence_input_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**kw)
    assert DrafterConfig().confidence_input == "hidden"
