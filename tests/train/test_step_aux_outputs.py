"""The features' auxiliary losses and metrics reach the train step through `ModelOutput`
(`aux_loss`, `metrics`): the per-step losses and every logged metric of tiny MoE + mHC runs
(scanned MoE layers, gradient accumulation, and Engram with row-sparse tables) equal the
values recorded with the earlier step, which read the sown intermediates itself
(step_aux_expected.json, recorded at commit 31aa510 plus the sharding change; to 1e-6)."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.sharding import make_mesh
from v41jax.train.state import make_state_fns
from v41jax.train.step import device_batch, make_train_step

EXPECTED_FILE = pathlib.Path(__file__).parent / "step_aux_expected.json"
MOE = [
    "model.moe.num_experts=4",
    "model.moe.num_shared_experts=1",
    "model.moe.d_expert=48",
    "model.moe.capacity_factor=1.0",  # some slots dropped: moe_dropped_fraction > 0
]
# recorded before the Sinkhorn polish existed: the plain iteration keeps those numbers
MHC = ["model.mhc.n_streams=4", "model.mhc.sinkhorn_newton_steps=0"]
ENGRAM = [
    "model.engram.layer_ids=0",
    "model.engram.engram_vocab_size=1000,1000",
    "model.engram.n_embed_per_ngram=32",
    "model.engram.n_head_per_ngram=2",
]
ONE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "optim.warmup_steps=1"]
RUNS = {
    # block_0 dense, layers_1_2 a scanned run of MoE blocks
    "moe_mhc_scan": MOE + MHC + ["model.num_layers=3", "model.moe.layer_ids=1,2"],
    "moe_mhc_micro": MOE + MHC + ["train.microbatches=2"],
    "engram_moe_mhc_sparse": MOE + MHC + ENGRAM + ["optim.table_optimizer=sparse_adam"],
}
STEPS = 3


def _batches(cfg, steps: int, seed: int = 0) -> list[dict]:
    """Deterministic synthetic batches [B, T] (Engram ids drawn below every head's size)."""
    rng = np.random.default_rng(seed)
    b, t, v = cfg.data.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, v, (b, t + 1)).astype(np.int32)
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
            "segment_ids": np.ones((b, t), np.int32),
            "loss_mask": (rng.random((b, t)) < 0.9).astype(np.float32),
        }
        engram = cfg.model.engram
        for layer in engram.layer_ids if engram.enabled else ():
            ids = rng.integers(0, 900, (b, t, engram.num_heads_total)).astype(np.int32)
            batch[f"engram_ids_{layer}"] = ids
        out.append(batch)
    return out


def run_steps(name: str) -> list[dict[str, float]]:
    """Every metric of STEPS train steps of run `name` from init_fn(0), as floats."""
    cfg = config_lib.override(config_lib.get_config("tiny"), RUNS[name] + ONE)
    mesh = make_mesh(cfg.mesh)
    model, optimizer, init_fn, shardings, _ = make_state_fns(cfg, mesh)
    step = make_train_step(cfg, mesh, model, optimizer, shardings)
    state, rows = init_fn(0), []
    for batch in _batches(cfg, STEPS):
        state, metrics = step(state, device_batch(mesh, batch))
        rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return rows


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_and_metrics_equal_the_recorded_run(name):
    got = run_steps(name)
    if os.environ.get("V41JAX_RECORD_STEP_AUX"):  # write the expected values, then fail
        data = json.loads(EXPECTED_FILE.read_text()) if EXPECTED_FILE.exists() else {}
        data[name] = got
        EXPECTED_FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        pytest.fail("recorded; rerun without V41JAX_RECORD_STEP_AUX")
    want = json.loads(EXPECTED_FILE.read_text())[name]
    assert len(got) == len(want) == STEPS
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert sorted(g) == sorted(w), f"step {i}: metric names differ"
        for key in w:
            np.testing.assert_allclose(
                g[key], w[key], rtol=1e-6, atol=1e-6, err_msg=f"step {i} {key}"
            )
    assert {"moe_aux_loss", "moe_dropped_fraction", "moe_max_load"} <= set(want[0])
    assert {"mhc_forward_gain", "mhc_backward_gain"} <= set(want[0])
