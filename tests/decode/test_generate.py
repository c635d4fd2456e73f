"""KV-cache generation: cached logits equal the full forward; greedy equals a naive loop."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.config import ModelConfig
from v41jax.decode import SamplingParams, decode_step, generate, init_cache, prefill
from v41jax.model import Transformer, init_params

CFG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32
)


@functools.cache
def params():
    return init_params(CFG, jax.random.key(0))


@functools.partial(jax.jit, static_argnames=("cfg",))
def full_logits(p, cfg, toks):
    return Transformer(cfg).apply({"params": p}, toks).logits


def test_init_cache_shapes():
    # one entry per segment: the two identical layers are one scanned run, stacked [L, ...]
    cache = init_cache(CFG, 3)
    assert list(cache) == ["layers_0_1"]
    assert cache["layers_0_1"]["k"].shape == (2, 3, CFG.max_seq_len, CFG.num_kv_heads, 8)
    assert cache["layers_0_1"]["v"].dtype == jnp.float32
    flat = init_cache(dataclasses.replace(CFG, scan_layers=False), 3)
    assert list(flat) == ["block_0", "block_1"]
    assert flat["block_1"]["k"].shape == (3, CFG.max_seq_len, CFG.num_kv_heads, 8)
    with pytest.raises(ValueError, match="keyed by the model's segments"):
        Transformer(CFG).apply({"params": params()}, jnp.zeros((3, 1), jnp.int32), cache=flat)


def test_cached_decoding_equals_full_forward_at_every_position():
    b, t = 3, 16
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)
    full = np.asarray(full_logits(params(), CFG, toks))
    lengths = np.array([2, 5, 9])
    # padding after each prompt is garbage that must never be attended
    padded = jnp.where(jnp.arange(t)[None] < lengths[:, None], toks, 7)
    last, cache = prefill(params(), CFG, padded, jnp.asarray(lengths))
    np.testing.assert_allclose(last, full[np.arange(b), lengths - 1], atol=1e-5)
    checked = 0
    for i in range(t - lengths.min()):
        pos = lengths + i
        fed = toks[np.arange(b), np.minimum(pos, t - 1)]
        logits, cache = decode_step(params(), CFG, fed, cache, jnp.asarray(pos))
        for row in np.nonzero(pos < t)[0]:
            np.testing.assert_allclose(logits[row], full[row, pos[row]], atol=1e-5)
            checked += 1
    assert checked == (t - lengths).sum()


def naive_greedy(toks, lengths, n):
    """Rerun the full forward on the growing sequences; argmax at each row's last token."""
    buf = np.zeros((toks.shape[0], CFG.max_seq_len), np.int32)
    buf[:, : toks.shape[1]] = toks
    lengths = lengths.copy()
    out = []
    for _ in range(n):
        logits = np.asarray(full_logits(params(), CFG, jnp.asarray(buf)))
        nxt = logits[np.arange(len(lengths)), lengths - 1].argmax(-1)
        buf[np.arange(len(lengths)), lengths] = nxt
        lengths += 1
        out.append(nxt)
    return np.stack(out, 1)


PROMPTS = np.asarray(jax.random.randint(jax.random.key(2), (3, 6), 0, 64, dtype=jnp.int32))
LENGTHS = np.array([2, 6, 4])


def test_greedy_generate_equals_naive_loop():
    got = generate(params(), CFG, PROMPTS, LENGTHS, max_new_tokens=6)
    assert got.shape == (3, 6) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, naive_greedy(PROMPTS, LENGTHS, 6))
    # top_k = 1 at any temperature is greedy too
    top1 = generate(
        params(),
        CFG,
        PROMPTS,
        LENGTHS,
        max_new_tokens=6,
        sampling=SamplingParams(temperature=2.0, top_k=1),
        rng=jax.random.key(5),
    )
    np.testing.assert_array_equal(top1, got)
    sampled = generate(
        params(),
        CFG,
        PROMPTS,
        LENGTHS,
        max_new_tokens=6,
        sampling=SamplingParams(temperature=5.0),
        rng=jax.random.key(5),
    )
    assert not np.array_equal(sampled, got)
    assert np.all((0 <= np.asarray(sampled)) & (np.asarray(sampled) < CFG.vocab_size))


def test_rows_keep_emitting_eos():
    greedy = np.asarray(generate(params(), CFG, PROMPTS, LENGTHS, max_new_tokens=6))
    eos = int(greedy[0, 1])
    got = np.asarray(generate(params(), CFG, PROMPTS, LENGTHS, max_new_tokens=6, eos_id=eos))
    want = greedy.copy()
    for row in want:
        hits = np.nonzero(row == eos)[0]
        if len(hits):
            row[hits[0] :] = eos
    np.testing.assert_array_equal(got, want)
    assert np.all(got[0, 1:] == eos)


@pytest.mark.parametrize(
    "lengths, kwargs, match",
    [
        ([2, 6, 4], {"max_new_tokens": 27}, r"6 \+ max_new_tokens 27 = 33 exceeds .*32"),
        ([0, 6, 4], {"max_new_tokens": 2}, r"\[1, P=6\]"),
        ([2, 7, 4], {"max_new_tokens": 2}, r"\[1, P=6\]"),
        ([2, 6], {"max_new_tokens": 2}, "shape"),
        ([2, 6, 4], {"max_new_tokens": 0}, "max_new_tokens"),
        ([2, 6, 4], {"max_new_tokens": 2, "temperature": -1.0}, "temperature"),
        ([2, 6, 4], {"max_new_tokens": 2, "top_p": 0.0}, "top_p"),
        ([2, 6, 4], {"max_new_tokens": 2, "top_p": 1.1}, "top_p"),
    ],
)
def test_bad_generate_args_raise(lengths, kwargs, match):
    sampling = {k: kwargs[k] for k in ("temperature", "top_p") if k in kwargs}
    kwargs = {k: v for k, v in kwargs.items() if k not in sampling}
    with pytest.raises(ValueError, match=match):
        if sampling:
            kwargs["sampling"] = SamplingParams(**sampling)
        generate(params(), CFG, PROMPTS, np.array(lengths), **kwargs)


def test_prompt_wider_than_cache_raises():
    wide = np.zeros((1, CFG.max_seq_len + 1), np.int32)
    with pytest.raises(ValueError, match="P=33 exceeds model.max_seq_len=32"):
        generate(params(), CFG, wide, np.array([1]), max_new_tokens=1)


def test_bf16_compute_generates_with_bf16_cache():
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    assert init_cache(bf16, 1)["layers_0_1"]["k"].dtype == jnp.bfloat16
    _, state = prefill(params(), bf16, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS))
    assert state.kv["layers_0_1"]["k"].dtype == jnp.bfloat16 and state.engram_window is None
    got = np.asarray(generate(params(), bf16, PROMPTS, LENGTHS, max_new_tokens=6))
    want = np.asarray(generate(params(), CFG, PROMPTS, LENGTHS, max_new_tokens=6))
    # Teacher-forced along the f32 greedy path, bf16 logits stay within TOL of f32's (bf16
    # keeps 8 mantissa bits; logits here are O(1)); greedy agrees wherever f32's top-2 margin
    # exceeds 2 TOL, up to the first position where it may legitimately diverge.
    tol = 0.05
    last = jnp.asarray(LENGTHS - 1)
    logits = {}
    for name, cfg in (("f32", CFG), ("bf16", bf16)):
        lg, st = prefill(params(), cfg, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS))
        steps = [np.asarray(lg)]
        for i in range(5):
            lg, st = decode_step(params(), cfg, jnp.asarray(want[:, i]), st, last + 1 + i)
            steps.append(np.asarray(lg))
        logits[name] = np.stack(steps, 1)  # [B, 6, V]
    assert np.abs(logits["bf16"] - logits["f32"]).max() < tol
    top2 = np.sort(logits["f32"], -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * tol
    checked = 0
    for row in range(3):
        for i in range(6):
            if not clear[row, i]:
                break  # past here the two paths may differ legitimately
            assert got[row, i] == want[row, i], (row, i)
            checked += 1
    assert checked >= 6  # not vacuous: most positions have a clear winner


def test_segment_ids_with_cache_raise():
    with pytest.raises(ValueError, match="segment_ids"):
        Transformer(CFG).apply(
            {"params": params()},
            jnp.asarray(PROMPTS),
            segment_ids_BxT=jnp.ones((3, 6)),
            cache=init_cache(CFG, 3),
        )


@pytest.mark.parametrize(
    "knobs",
    [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.2, 0, 0.7, 0.05),
     (np.array([0.0, 1.0, 0.5]), np.array([0, 2, 0]), 0.9, 0.0)],
)  # fmt: skip
def test_generate_plans_give_the_tokens_of_traced_knobs(knobs):
    """Python knobs let `generate` trace only the sampling stages they use (greedy: argmax
    alone; no filter: no sort); traced knobs trace all of them. Same key, same tokens."""
    t, k, p, m = knobs
    run = lambda t, k, p, m: generate(
        params(), CFG, PROMPTS, LENGTHS, max_new_tokens=6,
        sampling=SamplingParams(t, k, p, m), rng=jax.random.key(9), eos_id=3,
    )  # fmt: skip
    np.testing.assert_array_equal(run(t, k, p, m), jax.jit(run)(t, k, p, m))
