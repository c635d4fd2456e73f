"""`import-hf` / `export-hf`: an HF model directory becomes a workdir that `load_run`,
`eval`, `generate` and fine-tuning take, and goes back to an HF directory unchanged."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from v41jax.hf.checkpoint import tensor_files
from v41jax.train import load_run

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


def _with_tokenizer(family, dst):
    """The fixture plus a 300-token WordLevel tokenizer (eos "</s>" at 2), as any
    tokenizer.json with its tokenizer_config.json."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    shutil.copytree(os.path.join(FIXTURES, family), dst)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return dst


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "v41jax", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    src = _with_tokenizer("qwen3", str(root / "qwen3"))
    out = _cli("import-hf", src, "--workdir", str(root / "w"), "--config", "tiny",
               "--set", "mesh.data=1", "--set", "data.seq_len=32")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return src, str(root / "w"), json.loads(out.stdout)


@pytest.mark.e2e
def test_the_imported_workdir_gives_transformers_logits(imported):
    src, workdir, summary = imported
    assert summary["family"] == "qwen3" and summary["eos_id"] == 2
    run = load_run(workdir)
    assert run.step == 0 and run.tokenizer.eos_id == 2 and run.cfg.model.qk_norm
    with np.load(os.path.join(src, "golden.npz")) as f:
        ids, want = f["input_ids"], f["logits"]
    got = run.model.apply({"params": run.params}, jnp.asarray(ids)).logits
    assert float(np.abs(np.asarray(got) - want).max()) < 1e-5


@pytest.mark.e2e
def test_generate_and_export_take_it(imported, tmp_path):
    src, workdir, _ = imported
    gen = _cli("generate", "--workdir", workdir, "--prompt", "w3 w4", "--max-new-tokens", "4",
               "--temperature", "0")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    out = str(tmp_path / "exported")
    exp = _cli("export-hf", "--workdir", workdir, "--out", out, "--family", "qwen3")
    assert exp.returncode == 0, exp.stderr
    for name, path in tensor_files(src).items():
        with safe_open(path, "np") as a, safe_open(tensor_files(out)[name], "np") as b:
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    again = _cli("export-hf", "--workdir", workdir, "--out", out, "--family", "qwen3")
    assert again.returncode == 2 and "already holds" in again.stderr  # nothing overwritten
    bad = _cli("export-hf", "--workdir", workdir, "--out", str(tmp_path / "x"), "--family", "llama")
    assert bad.returncode == 2 and "not a llama model" in bad.stderr


@pytest.mark.e2e
def test_import_refuses_without_writing(tmp_path):
    src = _with_tokenizer("mistral", str(tmp_path / "m"))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf["sliding_window"] = 4096
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(hf, f)
    out = _cli("import-hf", src, "--workdir", str(tmp_path / "w"))
    assert out.returncode == 2 and "sliding_window=4096" in out.stderr
    assert not os.path.exists(tmp_path / "w")
    hf["sliding_window"] = None
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(hf, f)
    os.remove(os.path.join(src, "tokenizer.json"))
    out = _cli("import-hf", src, "--workdir", str(tmp_path / "w"))
    assert out.returncode == 2 and "tokenizer.json" in out.stderr


@pytest.mark.e2e
def test_fine_tuning_starts_from_the_imported_params(imported, tmp_path):
    from v41jax import config as config_lib
    from v41jax.train import train

    _, workdir, _ = imported
    run = load_run(workdir)
    cfg = config_lib.override(run.cfg, [f"train.init_from={workdir}", "train.steps=1",
                                        "train.eval_every=0", "train.eval_batches=1"])  # fmt: skip
    tuned = str(tmp_path / "tuned")
    train(cfg, tuned, progress=False)
    after = load_run(tuned).params
    moved = [float(jnp.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(run.params), jax.tree.leaves(after), strict=True)]  # fmt: skip
    assert 0 < max(moved) < 0.1  # one small step from the imported weights, not a fresh init


@pytest.mark.e2e
def test_engram_attached_to_the_imported_model_starts_at_its_function(imported, tmp_path):
    """--set model.engram.layer_ids=1 on a fine-tune of the imported model. After one step
    at lr 1e-30 (the params stay where they started) the validation loss is the imported
    model's: W_V starts at zero, so the Engram delta is 0. At the normal lr the memory
    learns from the first step (W_V leaves zero)."""
    from v41jax import config as config_lib
    from v41jax.train import evaluate_run, train

    _, workdir, _ = imported
    base = load_run(workdir).cfg
    sets = [f"train.init_from={workdir}", "train.steps=1", "train.eval_every=0",
            "train.eval_batches=1", "model.engram.layer_ids=1",
            "model.engram.engram_vocab_size=1009,1009"]  # fmt: skip
    frozen = train(config_lib.override(base, [*sets, "optim.lr=1e-30"]), str(tmp_path / "a"),
                   progress=False)  # fmt: skip
    want = evaluate_run(workdir, num_batches=1)["val_loss"]
    assert frozen["val_loss"] == pytest.approx(want, rel=1e-6, abs=1e-6)
    train(config_lib.override(base, sets), str(tmp_path / "b"), progress=False)
    w_v = [np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(
        load_run(str(tmp_path / "b")).params)[0] if "w_v" in jax.tree_util.keystr(p)]  # fmt: skip
    assert w_v and max(float(np.abs(x).max()) for x in w_v) > 0


@pytest.mark.e2e
def test_mhc_attached_to_the_imported_model_starts_at_its_function(imported, tmp_path):
    """--set model.mhc.n_streams=4 on a fine-tune of the imported model: phi starts at zero,
    so every stream stays the plain residual. After one step at lr 1e-30 the validation loss
    is the imported model's: to float rounding in form single_pass (its readout normalises
    H_pre X = h), and within the final norm's eps in form reference, whose readout is
    RMSNorm(n h) (the fixture's activations have RMS ~0.02, where eps = 1e-6 shows)."""
    from v41jax import config as config_lib
    from v41jax.train import evaluate_run, train

    _, workdir, _ = imported
    base = load_run(workdir).cfg
    want = evaluate_run(workdir, num_batches=1)["val_loss"]
    for form, rel in (("single_pass", 1e-6), ("reference", 1e-4)):
        sets = [f"train.init_from={workdir}", "train.steps=1", "train.eval_every=0",
                "train.eval_batches=1", "model.mhc.n_streams=4", f"model.mhc.form={form}",
                "optim.lr=1e-30"]  # fmt: skip
        got = train(config_lib.override(base, sets), str(tmp_path / form), progress=False)
        assert got["val_loss"] == pytest.approx(want, rel=rel), form
