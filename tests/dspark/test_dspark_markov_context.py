"""The contextual Markov head (`DrafterConfig.markov_context`): the bias against a NumPy
reference, an untrained head equals the plain one, the sampled q is the returned q, gradients
reach every table, bad input is named."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.decode.sampling import SamplingParams, sampling_probs
from v41jax.dspark.model.config import DrafterConfig
from v41jax.dspark.model.drafter import Drafter, frozen_target
from v41jax.dspark.model.markov import markov_bias, markov_draft, teacher_forced_logits
from v41jax.model import init_params

TARGET = ModelConfig(
    vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64
)


@functools.cache
def _models(h=8):
    """(target params, drafter params with an untrained contextual head of width h, frozen)."""
    dcfg = DrafterConfig(block_size=3, num_layers=1, num_heads=4, markov_rank=4, markov_context=h)
    tp = init_params(TARGET, jax.random.key(0))
    frozen = frozen_target(tp, TARGET)
    variables = Drafter(dcfg, TARGET).init(
        jax.random.key(1),
        frozen,
        np.zeros((1, 2, 2 * TARGET.d_model), np.float32),
        np.arange(2, dtype=np.int32)[None],
        np.ones((1, 2), bool),
        np.zeros((1, 1), np.int32),
        np.ones((1, 1), np.int32),
    )
    return tp, jax.tree.map(np.asarray, nn.unbox(variables["params"])), frozen, dcfg


def _params(v, r, d, h, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    shapes = {"u": (v, r), "w": (v, r), "t": (v, h), "h": (d, h), "o": (h, r)}
    return {n: jnp.asarray(scale * rng.normal(size=s), jnp.float32) for n, s in shapes.items()}


def _gelu(x):  # jax.nn.gelu's default (tanh) form
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _bias_ref(mp, prev, hidden):
    p = {n: np.asarray(x, np.float64) for n, x in mp.items()}
    u_k = p["u"][prev] + _gelu(hidden @ p["h"] + p["t"][prev]) @ p["o"]
    return u_k @ p["w"].T


def test_bias_and_teacher_forced_logits_by_hand():
    v, r, d, h = 13, 3, 6, 5
    rng = np.random.default_rng(0)
    mp = _params(v, r, d, h, 1)
    base = rng.normal(size=(2, 3, 4, v)).astype(np.float32)
    anchors, nxt = rng.integers(0, v, (2, 3)), rng.integers(0, v, (2, 3, 4))
    hidden = rng.normal(size=(2, 3, 4, d)).astype(np.float32)
    prev = np.concatenate([anchors[..., None], nxt[..., :-1]], axis=-1)
    want = _bias_ref(mp, prev, hidden)
    np.testing.assert_allclose(markov_bias(mp, prev, hidden), want, rtol=1e-5, atol=1e-5)
    got = teacher_forced_logits(base, mp, anchors, nxt, hidden)
    np.testing.assert_allclose(got, base + want, rtol=1e-5, atol=1e-5)


def test_untrained_contextual_head_is_the_plain_head():
    tp, dp, frozen, dcfg = _models()
    mk = dp["markov"]
    assert set(mk) == {"u", "w", "t", "h", "o"} and not np.asarray(mk["o"]).any()
    assert mk["t"].shape == (16, 8) and mk["h"].shape == (32, 8) and mk["o"].shape == (8, 4)
    prev = jnp.arange(6, dtype=jnp.int32)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(6, 32)), jnp.float32)
    plain = {n: mk[n] for n in ("u", "w")}
    np.testing.assert_allclose(markov_bias(mk, prev, hidden), markov_bias(plain, prev), atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_markov_draft_q_is_the_sampled_law(temperature):
    b, k, v, d = 48, 4, 11, 6
    rng = np.random.default_rng(3)
    base = jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(b, k, d)), jnp.float32)
    anchors = jnp.arange(b, dtype=jnp.int32) % v
    mp = _params(v, 3, d, 5, 2)
    probs_fn = functools.partial(sampling_probs, sampling=SamplingParams(temperature))
    drafts, q = jax.jit(markov_draft, static_argnums=4)(
        jax.random.key(5), base, anchors, mp, probs_fn, hidden
    )
    re = probs_fn(
        teacher_forced_logits(base[:, None], mp, anchors[:, None], drafts[:, None], hidden[:, None])
    )
    np.testing.assert_allclose(q, re[:, 0], rtol=0, atol=1e-6)
    assert (np.take_along_axis(np.asarray(q), np.asarray(drafts)[..., None], -1) > 0).all()
    if temperature == 0.0:  # the greedy chain, step by step through the NumPy bias
        prev = np.asarray(anchors)
        for i in range(k):
            logits = np.asarray(base[:, i], np.float64) + _bias_ref(mp, prev, hidden[:, i])
            prev = np.argmax(logits, -1)
            np.testing.assert_array_equal(drafts[:, i], prev)


def test_gradients_reach_every_table():
    from v41jax.dspark.train.config import DrafterTrainConfig
    from v41jax.dspark.train.objective import drafter_loss

    tp, dp, frozen, dcfg = _models()
    rng = np.random.default_rng(0)
    t = 12
    toks = rng.integers(0, 16, (2, t + 1)).astype(np.int32)
    batch = {
        "inputs": toks[:, :-1],
        "targets": toks[:, 1:],
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (2, t)),
        "segment_ids": np.ones((2, t), np.int32),
    }
    feats = jnp.asarray(rng.normal(size=(2, t, 2 * 32)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(2, t, 16)), jnp.float32)
    anchors = jnp.asarray(rng.integers(0, t - 1, (2, 3)), jnp.int32)
    loss = functools.partial(
        drafter_loss, drafter=dcfg, target_cfg=TARGET, train=DrafterTrainConfig()
    )
    grads = jax.grad(lambda p: loss(p, frozen, feats, logits, batch, anchors)[0])(dp)
    for name in ("u", "w", "o"):  # o = 0 at init: t and h get gradient once o moves
        assert np.abs(np.asarray(grads["markov"][name])).sum() > 0, name


def test_bad_input_is_named():
    mp = _params(7, 2, 4, 3, 0)
    prev = jnp.zeros((5,), jnp.int32)
    with pytest.raises(ValueError, match="needs hidden"):
        markov_bias(mp, prev)
    with pytest.raises(ValueError, match="needs hidden"):
        markov_bias(mp, prev, jnp.zeros((5, 3)))
    plain = {n: mp[n] for n in ("u", "w")}
    with pytest.raises(ValueError, match="plain head"):
        markov_bias(plain, prev, jnp.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"\[V, H\], \[D, H\], \[H, r\]"):
        markov_bias({**mp, "o": jnp.zeros((3, 5))}, prev, jnp.zeros((5, 4)))
    with pytest.raises(ValueError, match="keys"):
        markov_bias({**plain, "t": mp["t"]}, prev)
    base = jnp.zeros((5, 2, 7))
    with pytest.raises(ValueError, match="without markov_params"):
        markov_draft(jax.random.key(0), base, prev, None, jax.nn.softmax, jnp.zeros((5, 2, 4)))
    with pytest.raises(ValueError, match="markov_context=4 needs the Markov head"):
        DrafterConfig(kind="parallel", markov_rank=0, markov_context=4)
    with pytest.raises(ValueError, match="markov_context=-1"):
        DrafterConfig(markov_context=-1)
