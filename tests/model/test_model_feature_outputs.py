"""`ModelOutput.aux_loss` / `.metrics`: the features' auxiliary loss and metrics, reduced by
the model over depth from what its blocks return. They equal the reductions of the sown
intermediates (MoE `moe_metrics`, mHC `composite_gain` of the H_res in depth order), for a
scanned MoE run too; the aux loss carries the router's gradient; a plain model has none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from v41jax import config as config_lib
from v41jax.mhc import composite_gain
from v41jax.model import Transformer, init_params, moe_metrics, unscan_tree

MOE_MHC = [
    "model.num_layers=3",
    "model.moe.num_experts=4",
    "model.moe.d_expert=48",
    "model.moe.layer_ids=1,2",  # block_0 dense, layers_1_2 a scanned MoE run
    "model.moe.capacity_factor=1.0",
    "model.mhc.n_streams=4",
]
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)


def _model(overrides):
    cfg = config_lib.override(config_lib.get_config("tiny"), overrides).model
    return cfg, nn.unbox(init_params(cfg, jax.random.key(0)))


def test_feature_outputs_equal_the_sown_reductions():
    cfg, params = _model(MOE_MHC)
    out, state = Transformer(cfg).apply({"params": params}, TOKENS, mutable=["intermediates"])
    sown = unscan_tree(state["intermediates"], cfg.num_layers)
    moe = moe_metrics(sown)
    h_res = [h for i in range(cfg.num_layers) for h in sown[f"block_{i}"]["h_res"]]
    assert len(h_res) == 2 * cfg.num_layers
    gains = composite_gain(h_res)
    want = dict(
        moe, mhc_forward_gain=gains["forward_amax"], mhc_backward_gain=gains["backward_amax"]
    )
    assert sorted(out.metrics) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(out.metrics[k].value, v, rtol=1e-6, err_msg=k)
    # how microbatches combine each: MoE's batch statistics averaged, mHC's worst gain kept
    rules = {k: m.combine for k, m in out.metrics.items()}
    assert rules == {k: "max" if k.startswith("mhc_") else "mean" for k in want}
    np.testing.assert_allclose(out.aux_loss, cfg.moe.aux_loss_weight * moe["moe_aux_loss"])


def test_aux_loss_reaches_the_router():
    cfg, params = _model(MOE_MHC)
    grads = jax.grad(lambda p: Transformer(cfg).apply({"params": p}, TOKENS).aux_loss)(params)
    router = grads["layers_1_2"]["ffn"]["router"]
    assert router.shape[0] == 2 and float(jnp.abs(router).sum()) > 0
    assert float(jnp.abs(grads["layers_1_2"]["attn_mix"]["phi"]).sum()) > 0  # via the inputs
    assert float(jnp.abs(grads["embed"]["embedding"]).sum()) > 0


@pytest.mark.parametrize("overrides", [[], ["model.mhc.n_streams=4"]], ids=["plain", "mhc"])
def test_without_moe_there_is_no_aux_loss(overrides):
    cfg, params = _model(overrides)
    out = Transformer(cfg).apply({"params": params}, TOKENS)
    assert float(out.aux_loss) == 0.0
    assert set(out.metrics) == ({"mhc_forward_gain", "mhc_backward_gain"} if overrides else set())
