"""`v41jax.train.run.Run`, the workdir both trainers write: small files whole or not at all,
written by process 0 only, and a checkpoint's params read back without its optimizer state."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.train import run as run_lib
from v41jax.train.run import Run


def test_a_write_cut_short_keeps_the_old_eval_json(tmp_path, monkeypatch):
    """A kill mid-write (here: the text half written, then an error) leaves eval.json as it
    was: the text goes to a temporary file that only a whole write renames over it."""
    run = Run(tmp_path / "run", keep_checkpoints=1)
    run.write_eval({"step": 4, "val_loss": 2.5})
    before = (tmp_path / "run" / "eval.json").read_text()
    assert before == json.dumps({"step": 4, "val_loss": 2.5}, indent=2)
    path_type = type(run.path)
    real = path_type.write_text

    def cut_short(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(path_type, "write_text", cut_short)
    with pytest.raises(OSError, match="No space"):
        run.write_eval({"step": 8, "val_loss": 2.25})
    monkeypatch.undo()
    assert (tmp_path / "run" / "eval.json").read_text() == before
    assert run.read_eval() == {"step": 4, "val_loss": 2.5}


def test_only_process_0_writes_the_small_files(tmp_path, monkeypatch):
    """On any other process the record, eval.json and the log are not written (nor is the
    workdir made for them)."""
    monkeypatch.setattr(run_lib, "jax", types.SimpleNamespace(process_index=lambda: 1))
    run = Run(tmp_path / "run", keep_checkpoints=1)
    assert not run.writes
    run.write_json("drafter.json", {"config": {}}, sort_keys=True)
    run.write_eval({"step": 1})
    log = run.open_log(0)
    log({"step": 1, "loss": 1.0})
    run.close()
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    main = Run(tmp_path / "run", keep_checkpoints=1)
    main.write_eval({"step": 1})
    assert main.read_eval() == {"step": 1}


def test_restore_params_reads_the_params_alone(tmp_path):
    """`restore_params` needs no structure for the optimizer state: any saved one reads."""
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
    opt_state = [jnp.zeros(()), {"mu": jnp.ones((2, 3)), "nu": (jnp.ones(3), jnp.ones(1))}]
    run = Run(tmp_path / "run", keep_checkpoints=2)
    assert not (tmp_path / "run").exists()  # nothing is made before it is asked for
    run.checkpointer().save(5, {"params": params, "opt_state": opt_state}, {"iterator": 5})
    run.close()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)  # noqa: E731
    abstract = jax.tree.map(place, params)
    again = Run(tmp_path / "run", keep_checkpoints=2)
    assert again.checkpointer().latest_step() == 5
    restored = again.restore_params(5, abstract)
    again.close()
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
