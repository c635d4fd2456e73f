"""q/k/v biases (Qwen2) and q/k RMSNorms (Qwen3): their params, and KV-cache decoding equal
to the full forward with them set to random values (the biases and norm scales enter the
cached keys, so a cache written without them would differ)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from v41jax.config import ModelConfig
from v41jax.decode import decode_step, prefill
from v41jax.model import Transformer, init_params

BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64,
            max_seq_len=32, scan_layers=False)  # fmt: skip


def _randomised(cfg):
    """Params with every bias and norm scale drawn at random (init gives zeros and ones)."""
    flat = traverse_util.flatten_dict(nn.unbox(init_params(cfg, jax.random.key(0))))
    keys = iter(jax.random.split(jax.random.key(1), len(flat)))
    for path, x in flat.items():
        if path[-1].endswith("bias") or path[-1] == "scale":
            flat[path] = x + 0.5 * jax.random.normal(next(keys), x.shape, x.dtype)
    return traverse_util.unflatten_dict(flat)


@pytest.mark.parametrize("bias,norm", [(True, False), (False, True), (True, True)])
def test_cached_decoding_equals_the_full_forward(bias, norm):
    cfg = ModelConfig(**BASE, attention_bias=bias, qk_norm=norm)
    params = _randomised(cfg)
    attn = params["block_0"]["attn"]
    assert ("q_bias" in attn) == bias and ("q_norm" in attn) == norm
    if bias:
        assert attn["q_bias"].shape == (4, 8) and attn["v_bias"].shape == (2, 8)
    if norm:
        assert attn["k_norm"]["scale"].shape == (8,)
    b, t = 2, 12
    toks = jax.random.randint(jax.random.key(2), (b, t), 0, 64, dtype=jnp.int32)
    full = np.asarray(Transformer(cfg).apply({"params": params}, toks).logits)
    lengths = np.array([3, 7])
    last, cache = prefill(params, cfg, toks, jnp.asarray(lengths))
    np.testing.assert_allclose(last, full[np.arange(b), lengths - 1], atol=1e-5)
    step = functools.partial(decode_step, params, cfg)
    for i in range(t - lengths.max()):
        pos = lengths + i
        logits, cache = step(toks[np.arange(b), pos], cache, jnp.asarray(pos))
        np.testing.assert_allclose(logits, full[np.arange(b), pos], atol=1e-5)


def test_run_identities_recorded_before_the_fields_existed_stay_valid():
    """A drafter records its target's `run_identity`: the hashes of the named configs as
    computed before attention_bias / qk_norm / engram.table_momentum existed (the previous
    release) still match; turning a feature on, or moving the new field off its default,
    changes the hash."""
    import dataclasses

    from v41jax.config import get_config
    from v41jax.train.resume import run_identity

    recorded = {  # every named config, hashed by the release before these fields
        "1b": "d956e80168b5d6ad", "1b-engram": "3fa6a7735045ed64", "1b-mhc": "583c55ec9a0ed241",
        "8b": "ee0409c564e805ec", "8b-engram": "165943580bb68c30", "8b-mhc": "1a0abb1b20d41488",
        "small": "94f1714d4e828254", "tiny": "0fe5a6e467cec1a8",
    }  # fmt: skip

    def as_recorded(cfg):  # mHC configs: the Sinkhorn polish came later (saved ones load 0)
        if not cfg.model.mhc.n_streams:
            return cfg
        mhc = dataclasses.replace(cfg.model.mhc, sinkhorn_newton_steps=0)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mhc=mhc))

    assert {name: run_identity(as_recorded(get_config(name))) for name in recorded} == recorded
    cfg = get_config("tiny")
    on = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_norm=True))
    assert run_identity(on) != run_identity(cfg)
    engram = dataclasses.replace(cfg.model.engram, table_momentum=0.9)
    moved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engram=engram))
    assert run_identity(moved) != run_identity(cfg)
    groups = tuple(dataclasses.replace(g, rule="sinkhorn") for g in cfg.optim.param_groups)
    ruled = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, param_groups=groups))
    assert groups and run_identity(ruled) != run_identity(cfg)
