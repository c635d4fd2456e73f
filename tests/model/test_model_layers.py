"""Pure cores of v41jax.model.layers and attention: formulas, RoPE, GQA, masks, cache writes."""

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.model import (
    apply_rope,
    attention_reference,
    causal_attention,
    make_attention_mask,
    rms_norm,
    swiglu,
    update_cache,
)


def test_rms_norm_formula_and_dtype():
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    scale = jnp.linspace(0.5, 1.5, 8)
    want = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(rms_norm(x, scale, 1e-6), want, rtol=1e-5, atol=1e-6)
    y = rms_norm(x.astype(jnp.bfloat16), scale, 1e-6)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_rope_preserves_norm_and_depends_on_relative_position():
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, 1, 2, 16))
    k = jax.random.normal(kk, (1, 1, 2, 16))
    pos = lambda p: jnp.full((1, 1), p)
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rope(q, pos(7), 1e4), axis=-1),
        jnp.linalg.norm(q, axis=-1),
        rtol=1e-5,
    )

    def score(m, n):
        return jnp.sum(apply_rope(q, pos(m), 1e4) * apply_rope(k, pos(n), 1e4), -1)

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-4, atol=1e-5)
    assert not np.allclose(score(5, 2), score(5, 4), atol=1e-3)
    np.testing.assert_allclose(apply_rope(q, pos(0), 1e4), q, atol=1e-6)  # position 0: identity


def test_swiglu_formula():
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (2, 3, 4))
    wg, wu = jax.random.normal(ks[1], (4, 6)), jax.random.normal(ks[2], (4, 6))
    wd = jax.random.normal(ks[3], (6, 4))
    g = x @ wg
    want = (g / (1 + np.exp(-g)) * (x @ wu)) @ wd
    np.testing.assert_allclose(swiglu(x, wg, wu, wd), want, rtol=1e-4, atol=1e-4)


def test_gqa_equals_repeated_kv_reference():
    b, t, h, g, k = 2, 5, 6, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (b, t, h, k))
    keys = jax.random.normal(kk, (b, t, g, k))
    vals = jax.random.normal(kv, (b, t, g, k))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = make_attention_mask(pos, pos)
    got = causal_attention(q, keys, vals, mask)
    np.testing.assert_allclose(got, attention_reference(q, keys, vals, mask), atol=1e-5)
    # query head h reads kv head h // (H / G)
    one = causal_attention(q[:, :, 3:4], keys[:, :, 1:2], vals[:, :, 1:2], mask)
    np.testing.assert_allclose(got[:, :, 3:4], one, atol=1e-6)


def test_attention_mask_causal_and_segments():
    pos = jnp.arange(4)[None]
    seg = jnp.array([[1, 1, 2, 2]])
    mask = np.asarray(make_attention_mask(pos, pos, seg, seg)[0])
    want = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(mask, want)
    # with a cache: queries at slots 2, 3 see slots <= their own, of 6
    mask = np.asarray(make_attention_mask(jnp.array([[2, 3]]), jnp.arange(6)[None])[0])
    np.testing.assert_array_equal(mask.sum(-1), [3, 4])


def test_update_cache_writes_each_row_at_its_offset():
    cache = jnp.zeros((2, 6, 1, 1))
    new = jnp.ones((2, 2, 1, 1)) * jnp.array([1.0, 2.0])[:, None, None, None]
    out = np.asarray(update_cache(cache, new, jnp.array([0, 3]))[..., 0, 0])
    np.testing.assert_array_equal(out, [[1, 1, 0, 0, 0, 0], [0, 0, 0, 2, 2, 0]])
