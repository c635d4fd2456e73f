"""examples/: each script's main() runs and does what its docstring says; the public API of
`v41jax` (lazy attributes) resolves every name and imports no jax on `import v41jax`."""

import functools
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import v41jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NAMES = ["engram_nnx", "engram_raw_jit", "speculative_own_sampler", "mhc_shard_map"]


@functools.cache
def load(name: str):
    """Import examples/<name>.py by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"v41jax_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _g_test_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a G-test of counts against the law probs (float64, renormalised)."""
    law = probs.astype(np.float64) / probs.astype(np.float64).sum()
    return float(stats.power_divergence(counts, counts.sum() * law, lambda_="log-likelihood")[1])


def test_engram_nnx_bridge_matches_linen_and_trains_addressed_rows():
    ex = load("engram_nnx")
    r = ex.main(batch=2, length=12, seed=0)
    b, t = r["tokens"].shape
    assert r["delta"].shape == r["h"].shape == (b, t, ex.WIDTH)
    assert r["logits"].shape == (b, t, ex.VOCAB)
    assert np.abs(np.asarray(r["delta"])).max() > 1e-3  # Engram contributes something
    # The ids the model hashed on device are the host pipeline's.
    host_ids = v41jax.ngram_hash_ids_np(np.asarray(r["tokens"]), ex.LAYER_ID, ex.CFG)
    np.testing.assert_array_equal(np.asarray(r["hash_ids"]), host_ids)
    # Bridge exactness: the Linen module applied to the bridged module's params.
    linen = ex.linen_engram().apply({"params": r["params"]}, r["h"], r["hash_ids"])
    np.testing.assert_allclose(np.asarray(r["delta"]), np.asarray(linen), rtol=0, atol=1e-6)
    assert set(r["params"]) == set(v41jax.engram_param_shapes(ex.CFG, ex.LAYER_ID, ex.WIDTH)), (
        sorted(r["params"])
    )
    # One training step moved exactly the table rows the batch addressed, and not all rows.
    assert np.isfinite(r["loss"])
    assert 0 < r["addressed_rows"].size < r["table_rows"]
    np.testing.assert_array_equal(r["changed_rows"], r["addressed_rows"])


def test_engram_raw_jit_equals_linen_module():
    ex = load("engram_raw_jit")
    r = ex.main(batch=3, length=10, seed=0)
    tokens, h, params = r["tokens"], r["h"], r["params"]
    host_ids = v41jax.ngram_hash_ids_np(np.asarray(tokens), ex.LAYER_ID, ex.CFG)
    assert r["hash_ids"].shape == (*tokens.shape, ex.CFG.num_heads_total)
    np.testing.assert_array_equal(np.asarray(r["hash_ids"]), host_ids)
    engram = v41jax.Engram(ex.CFG, layer_id=ex.LAYER_ID, hidden_size=ex.WIDTH)
    linen = np.asarray(engram.apply({"params": params}, h, host_ids))
    assert r["delta"].shape == h.shape
    np.testing.assert_allclose(np.asarray(r["delta"]), linen, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(r["delta_one_call"]), linen, rtol=1e-5, atol=1e-5)
    # Negative control: the comparison sees the table (a zero table gives another output).
    zeroed = {**params, "table": np.zeros_like(params["table"])}
    other = np.asarray(engram.apply({"params": zeroed}, h, host_ids))
    assert np.abs(other - linen).max() > 1e-2


def test_speculative_own_sampler_audit_and_empirical_law():
    ex = load("speculative_own_sampler")
    r = ex.main(num_rows=20_000, audit_samples=20_000, seed=0)
    exact, wrong = r["audits"]["exact"], r["audits"]["always_accept"]
    assert exact.passed, exact.format()
    assert not wrong.passed
    assert wrong.failed and any(c.name.startswith("law") for c in wrong.failed)
    p0, q0 = r["target"][0], r["draft"][0]
    assert np.abs(p0 - q0).sum() > 0.5  # the two laws are far apart, so the test has power
    counts = r["counts"]
    assert counts["exact"].sum() == counts["always_accept"].sum() == 20_000
    assert _g_test_p(counts["exact"], p0) > 1e-3  # the exact rule emits the target's law
    assert _g_test_p(counts["always_accept"], p0) < 1e-6  # always accepting does not
    assert _g_test_p(counts["always_accept"], q0) > 1e-3  # ... it emits the draft's


def test_mhc_shard_map_equals_unsharded_and_mixing_is_doubly_stochastic():
    import jax
    from jax.sharding import PartitionSpec as P

    ex = load("mhc_shard_map")
    r = ex.main(rows_per_device=2, length=5, seed=0)
    assert r["num_devices"] == len(jax.devices()) == 8  # tests/conftest.py's fake devices
    assert r["out"].shape == r["h"].shape == (2 * 8, 5, ex.WIDTH)
    assert r["out_sharding"].spec == P("data")
    assert len(r["out"].addressable_shards) == 8
    np.testing.assert_allclose(
        np.asarray(r["out"]), np.asarray(r["out_unsharded"]), rtol=1e-5, atol=1e-5
    )
    h_res = np.asarray(r["h_res"])
    np.testing.assert_allclose(h_res, np.asarray(r["h_res_unsharded"]), rtol=1e-5, atol=1e-5)
    assert h_res.shape == (ex.LAYERS, 2 * 8, 5, ex.N_STREAMS, ex.N_STREAMS)
    assert h_res.min() >= 0
    assert np.abs(h_res.sum(-1) - 1).max() < 1e-5  # rows
    assert np.abs(h_res.sum(-2) - 1).max() < 1e-5  # columns
    assert h_res.reshape(-1, ex.N_STREAMS**2).std(0).max() > 1e-4  # per-token, not constant
    # mHC changed the computation: the output is not n copies of the input.
    assert np.abs(np.asarray(r["out"]) - ex.N_STREAMS * np.asarray(r["h"])).max() > 1e-2


def test_public_api_names_resolve():
    assert v41jax.__all__ == sorted(set(v41jax.__all__))
    for name in v41jax.__all__:
        assert getattr(v41jax, name) is not None, name
        assert name in dir(v41jax)
    assert v41jax.Engram is v41jax.engram.Engram
    assert v41jax.speculative_sample is v41jax.speculative.speculative_sample
    assert v41jax.load_hf is v41jax.hf.load_hf
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        v41jax.not_a_name  # noqa: B018


def test_import_v41jax_loads_no_jax():
    code = (
        "import sys, v41jax\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert 'jax' not in sys.modules and not heavy, heavy\n"
        "assert 'Transformer' in v41jax.__all__ and 'jax' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", NAMES)
def test_examples_use_the_public_api_and_are_documented(name):
    source = (EXAMPLES / f"{name}.py").read_text()
    assert "def main(" in source and '__name__ == "__main__"' in source
    assert "from v41jax import" in source
    assert f"python examples/{name}.py" in (EXAMPLES / "README.md").read_text()
    assert len(source.splitlines()) < 400
