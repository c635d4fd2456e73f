"""train.init_from: a fresh run starts from another run's params (fine-tuning on other text);
a run whose model differs is refused with the differing fields named."""

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.train import load_run, train


def _cfg(*sets):
    base = ["train.steps=4", "train.eval_every=0", "train.checkpoint_every=4"]
    return config_lib.override(config_lib.get_config("tiny"), base + list(sets))


def test_fine_tuning_starts_from_the_source_params(tmp_path):
    source = str(tmp_path / "source")
    train(_cfg(), source, progress=False)
    tuned = str(tmp_path / "tuned")
    # lr ~ 0: after two steps the params are still the source's (a fresh init would differ).
    # Other text (fewer documents): the source's tokenizer is kept, not retrained.
    train(
        _cfg(
            "train.steps=2", f"train.init_from={source}", "optim.lr=1e-12", "data.max_documents=20"
        ),
        tuned,
        progress=False,
    )
    a = jax.tree.leaves(load_run(source).params)
    b = jax.tree.leaves(load_run(tuned).params)
    assert (
        max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))
        < 1e-6
    )
    with open(f"{source}/tokenizer.json") as f, open(f"{tuned}/tokenizer.json") as g:
        assert f.read() == g.read()
    with pytest.raises(ValueError, match="model differs"):
        train(
            _cfg(f"train.init_from={source}", "model.d_ff=96"),
            str(tmp_path / "bad"),
            progress=False,
        )


def test_fine_tuning_converts_the_layer_layout(tmp_path):
    """A source trained with unrolled layers (block_i) seeds a scanned run (layers_a_b) and a
    different remat policy: the params are the source's, stacked."""
    from v41jax.model import convert_layout, layer_segments

    source = str(tmp_path / "source")
    train(_cfg("model.scan_layers=false"), source, progress=False)
    tuned = str(tmp_path / "tuned")
    train(
        _cfg(
            "train.steps=2",
            f"train.init_from={source}",
            "optim.lr=1e-12",
            "model.remat_policy=full",
        ),
        tuned,
        progress=False,
    )
    src, out = load_run(source), load_run(tuned)
    assert any(name.startswith("layers_") for name in out.params)
    assert not any(name.startswith("layers_") for name in src.params)
    want = convert_layout(src.params, layer_segments(out.cfg.model))
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(out.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
