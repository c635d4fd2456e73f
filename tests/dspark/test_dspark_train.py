"""Frozen-backbone drafter training: the target's params are bit-identical afterwards and not
in the optimizer, a killed run resumes exactly, realignment starts from a drafter's params,
and the CLI (train-drafter, generate --drafter) works end to end."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.dspark.train.load import load_drafter
from v41jax.dspark.train.loop import train_drafter
from v41jax.dspark.train.self_text import write_target_samples
from v41jax.train import load_run, train
from v41jax.train.checkpoint import DamagedCheckpointError
from v41jax.train.metrics import read_metrics

SETTINGS = [
    "drafter.num_layers=1",
    "drafter.block_size=3",
    "drafter.markov_rank=4",
    "drafter.window=16",
    "train.batch_size=8",
    "train.anchors_per_seq=2",
    "train.steps=8",
    "train.checkpoint_every=4",
    "train.keep_checkpoints=3",
    "train.log_every=2",
    "train.eval_every=0",
    "train.eval_batches=1",
]


def drafter_cfg(*extra):
    return config_lib.override(DrafterRunConfig(), SETTINGS + list(extra))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("target"))
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        ["train.steps=6", "train.eval_every=0", "model.max_seq_len=64"],
    )
    train(cfg, workdir, progress=False)
    return workdir


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    """(workdir, result, the target's params before) of a drafter trained for 8 steps with
    `drafter_cfg()`: one training run for several tests. Read only: a test that changes a
    drafter changes a `_copy` of it."""
    before = _leaves(load_run(target).params)
    workdir = str(tmp_path_factory.mktemp("drafters") / "base")
    result = train_drafter(drafter_cfg(), target, workdir, progress=False)
    return workdir, result, before


def _copy(drafter, name):
    """A copy of the module's drafter beside it (so its relative path to the target holds)."""
    workdir = os.path.join(os.path.dirname(drafter[0]), name)
    shutil.copytree(drafter[0], workdir)
    return workdir


def test_backbone_is_bit_identical_and_outside_the_optimizer(target, drafter):
    workdir, result, before = drafter
    assert result["step"] == 8 and np.isfinite(result["val_loss"])
    after = _leaves(load_run(target).params)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    cfg, params, record = load_drafter(workdir)
    assert record["target_step"] == 6 and record["step"] == 8
    n_drafter = sum(x.size for x in jax.tree.leaves(params))
    # AdamW keeps two moments per drafter param and a step count: nothing of the target's.
    from v41jax.dspark.train.state import drafter_optimizer

    opt_state = drafter_optimizer(cfg, params).init(params)
    n_opt = sum(np.size(x) for x in jax.tree.leaves(opt_state))
    assert n_opt <= 2 * n_drafter + 8
    assert not any(x.shape == (512, 64) for x in jax.tree.leaves(params))  # no embedding table
    init = load_drafter(workdir, step=4)[1]
    assert any(
        not np.array_equal(a, b) for a, b in zip(_leaves(init), _leaves(params), strict=True)
    )


def test_resume_is_exact_and_config_changes_are_refused(target, drafter):
    final = _leaves(load_drafter(drafter[0])[1])
    workdir = _copy(drafter, "resumed")
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))  # as if killed after step 4
    os.remove(os.path.join(workdir, "eval.json"))
    train_drafter(drafter_cfg(), target, workdir, progress=False)
    again = _leaves(load_drafter(workdir)[1])
    assert all(np.array_equal(a, b) for a, b in zip(final, again, strict=True))
    with pytest.raises(ValueError, match="train.lr"):
        train_drafter(drafter_cfg("train.lr=0.1"), target, workdir, progress=False)


def test_realignment_starts_from_the_given_drafter(target, drafter, tmp_path):
    first = drafter[0]
    start = _leaves(load_drafter(first)[1])
    second = str(tmp_path / "second")
    cfg = drafter_cfg("train.steps=4", "train.lr=1e-9", "train.warmup_steps=0")
    train_drafter(cfg, target, second, init_from=first, progress=False)
    moved = _leaves(load_drafter(second)[1])
    assert max(np.abs(a - b).max() for a, b in zip(start, moved, strict=True)) < 1e-5


def test_drafter_trains_on_the_targets_own_samples(target, tmp_path):
    """write_target_samples writes one text file per sample of the target (once: a rerun with
    the same settings regenerates nothing, other settings are refused), and a drafter trains
    on them through train.data_paths."""
    run, out = load_run(target), str(tmp_path / "samples")
    kw = dict(num_samples=60, prompt_len=4, new_tokens=40, batch_size=32, progress=False)
    kw["samples_per_file"] = 15  # documents long enough for the tiny config's val split
    record = write_target_samples(run, out, **kw)
    files = sorted(f for f in os.listdir(out) if f.endswith(".txt"))
    assert len(files) == 4 and 0 < record["new_tokens_written"] <= 60 * 40
    stamp = os.path.getmtime(os.path.join(out, files[0]))
    assert write_target_samples(run, out, **kw) == record
    assert os.path.getmtime(os.path.join(out, files[0])) == stamp
    with pytest.raises(ValueError, match="not .*'temperature': 0.5"):
        write_target_samples(run, out, **{**kw, "temperature": 0.5})
    with pytest.raises(ValueError, match="max_seq_len 64"):
        write_target_samples(run, str(tmp_path / "x"), **{**kw, "new_tokens": 80})
    # the module drafter's settings: the same train step, so its compiled program is reused
    cfg = drafter_cfg(f"train.data_paths={out}")
    result = train_drafter(cfg, target, str(tmp_path / "drafter"), progress=False)
    assert result["step"] == 8 and np.isfinite(result["val_loss"])


@pytest.mark.e2e
def test_cli_train_drafter_then_generate(target, tmp_path):
    workdir = str(tmp_path / "cli")
    sets = [x for s in SETTINGS for x in ("--set", s)]  # the step the cache holds compiled
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "v41jax", *a], capture_output=True, text=True, timeout=300
    )
    out = run("train-drafter", "--target-workdir", target, "--workdir", workdir, *sets)
    assert out.returncode == 0, out.stderr
    gen = run(
        "generate",
        "--workdir",
        target,
        "--drafter",
        workdir,
        "--prompt",
        "The",
        "--max-new-tokens",
        "8",
        "--schedule",
        "scheduled",
    )
    assert gen.returncode == 0, gen.stderr
    assert "tokens per round (scheduled, padded)" in gen.stderr
    # widths from 1, or from 0 where the engine also measures a plain decode step (width 0)
    assert re.search(r"measuring the decode-round cost at verify widths [01]\.\.3", gen.stderr)
    assert re.search(r"timing (verify )?widths", gen.stderr)  # its progress bar
    assert glob.glob(os.path.join(workdir, "loop_round_cost_b1_s*.json"))  # S: the context
    ragged = run(
        "generate", "--workdir", target, "--drafter", workdir, "--prompt", "The",
        "--max-new-tokens", "8", "--verify", "ragged",
    )  # fmt: skip
    assert ragged.returncode == 0, ragged.stderr
    assert "measuring the decode-round cost at packed sizes" in ragged.stderr
    assert "tokens per round (scheduled, ragged)" in ragged.stderr
    assert glob.glob(os.path.join(workdir, "ragged_round_cost_b1_s*.json"))  # S: the context
    # the ragged engine decodes the greedy prompt as the padded one does
    greedy = ["--temperature", "0"]
    outs = [
        run("generate", "--workdir", target, "--drafter", workdir, "--prompt", "The",
            "--max-new-tokens", "8", "--verify", v, *greedy).stdout
        for v in ("padded", "ragged")
    ]  # fmt: skip
    assert outs[0] == outs[1] and outs[0]
    bad = run(
        "train-drafter",
        "--target-workdir",
        target,
        "--workdir",
        workdir,
        "--set",
        "drafter.kind=eagle",
    )
    assert bad.returncode == 2 and "drafter.kind='eagle'" in bad.stderr


def _snapshot(workdir):
    out = {}
    for root, _, files in os.walk(workdir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), workdir)] = f.read()
    return out


def test_a_drafter_checks_its_target(target, drafter, tmp_path):
    """A drafter records its target's run identity: a different target (here the same shapes,
    another seed: before, it ran silently) is a clear error; a moved target is accepted; a
    refused train-drafter changes nothing, and a missing target creates no workdir."""
    workdir = _copy(drafter, "checked")
    with open(os.path.join(workdir, "drafter.json")) as f:
        record = json.load(f)
    assert not os.path.isabs(record["target_workdir"]) and record["target_identity"]

    other = str(tmp_path / "other_target")
    cfg = config_lib.override(
        config_lib.get_config("tiny"),
        ["train.steps=2", "train.eval_every=0", "model.max_seq_len=64", "train.seed=1"],
    )
    train(cfg, other, progress=False)
    with pytest.raises(ValueError, match="trained for the target .* a different model or data"):
        load_drafter(workdir, target=load_run(other))
    before = _snapshot(workdir)
    with pytest.raises(ValueError, match="target_identity"):
        train_drafter(drafter_cfg(), other, workdir, progress=False)
    with pytest.raises(ValueError, match="train.lr"):
        train_drafter(drafter_cfg("train.lr=0.1"), target, workdir)
    assert _snapshot(workdir) == before

    moved = str(tmp_path / "moved_target")
    shutil.copytree(target, moved)
    train_drafter(drafter_cfg(), moved, workdir, progress=False)  # resumes (finished)
    _, _, rec = load_drafter(workdir)
    assert os.path.samefile(os.path.join(workdir, rec["target_workdir"]), moved)

    missing = str(tmp_path / "new_drafter")
    with pytest.raises(FileNotFoundError, match="holds no run"):
        train_drafter(drafter_cfg(), str(tmp_path / "no_target"), missing, progress=False)
    assert not os.path.exists(missing)


def test_a_drafter_kind_sets_its_own_defaults():
    from v41jax.dspark.train.config import override_run_config

    mtp1 = override_run_config(DrafterRunConfig(), ["drafter.kind=mtp1"]).drafter
    assert (mtp1.kind, mtp1.block_size) == ("mtp1", 1)
    parallel = override_run_config(DrafterRunConfig(), ["drafter.kind=parallel"]).drafter
    assert (parallel.kind, parallel.markov_rank, parallel.block_size) == ("parallel", 0, 5)
    with pytest.raises(ValueError, match="block_size=3 != 1"):  # an explicit value still wins
        override_run_config(DrafterRunConfig(), ["drafter.kind=mtp1", "drafter.block_size=3"])


def make_train_step(cfg, target_cfg, layer_ids, params):
    """(optimizer, step(state, target_params, frozen, batch, anchors)): the frozen-target
    pass then the drafter's update (`make_update`), for one drafter with `params`' tree."""
    import functools

    from v41jax.dspark.train.objective import target_features
    from v41jax.dspark.train.state import drafter_optimizer
    from v41jax.dspark.train.step import make_update

    optimizer = drafter_optimizer(cfg, params)
    update = make_update(cfg, target_cfg, optimizer)
    features = jax.jit(
        functools.partial(target_features, target_cfg=target_cfg, layer_ids=tuple(layer_ids))
    )

    def step(state, target_params, frozen, batch, anchors):
        feats, logits = features(target_params, batch=batch)
        return update(state, frozen, feats, logits, batch, anchors)

    return optimizer, step


# drafter.json's "train" as every drafter run has written it (before and after the drafter's
# train config took its optimizer and loop settings from the main trainer's configs)
RECORDED_TRAIN = {
    "anchors_per_seq": 2,
    "batch_size": 8,
    "checkpoint_every": 4,
    "conf_weight": 1.0,
    "data_paths": [],
    "decay": 0.8,
    "eval_batches": 1,
    "eval_every": 0,
    "grad_clip": 1.0,
    "keep_checkpoints": 3,
    "log_every": 2,
    "lr": 0.002,
    "seed": 0,
    "steps": 8,
    "targets": "distribution",
    "tv_weight": 0.0,
    "warmup_steps": 50,
    "weight_decay": 0.0,
}


def test_the_drafter_train_config_composes_the_trainers_configs(drafter):
    """train.lr, warmup_steps, weight_decay, grad_clip are the drafter's `OptimConfig`, the
    step count, seed and cadence its `TrainConfig` (`config.inline`): drafter.json keeps its
    flat keys and values, a record of that layout loads, and `--set train.lr` sets
    train.optim.lr."""
    from v41jax.config import OptimConfig, TrainConfig
    from v41jax.dspark.train.config import drafter_optim

    with open(os.path.join(drafter[0], "drafter.json")) as f:
        record = json.load(f)
    assert record["config"]["train"] == RECORDED_TRAIN
    cfg = config_lib.from_dict(DrafterRunConfig, {**record["config"], "train": RECORDED_TRAIN})
    assert cfg == drafter_cfg()
    assert isinstance(cfg.train.optim, OptimConfig) and isinstance(cfg.train.loop, TrainConfig)
    assert cfg.train.optim == drafter_optim() and cfg.train.optim.param_groups == ()
    assert (cfg.train.loop.steps, cfg.train.loop.checkpoint_every) == (8, 4)
    faster = config_lib.override(cfg, ["train.lr=0.01", "train.seed=3"])
    assert (faster.train.optim.lr, faster.train.loop.seed) == (0.01, 3)
    assert config_lib.diff(cfg, faster) == ["train.lr: 0.002 -> 0.01", "train.seed: 0 -> 3"]
    with pytest.raises(KeyError, match="train.z_loss"):  # only the drafter's own settings
        config_lib.override(cfg, ["train.z_loss=1"])


@pytest.mark.parametrize("head", ["hidden", "prev_token"])
def test_a_short_run_lowers_the_confidence_bce_of_either_head(target, head):
    """30 steps on one fixed batch (fixed anchors): the confidence BCE against 1 - TV falls,
    for the "prev_token" head too (its term reads the true previous token, teacher forced)."""
    import jax.numpy as jnp

    from v41jax.dspark.model.drafter import frozen_target
    from v41jax.dspark.train.objective import eval_metrics
    from v41jax.dspark.train.step import init_drafter_params

    run = load_run(target)
    cfg = drafter_cfg(f"drafter.confidence_input={head}", "train.lr=3e-3", "train.warmup_steps=0")
    cfg = config_lib.override(cfg, ["train.steps=30"])
    tcfg = run.cfg.model
    layer_ids = cfg.drafter.layer_ids_for(tcfg.num_layers)
    frozen = frozen_target(run.params, tcfg)
    params = init_drafter_params(cfg, tcfg, frozen, seed=0)
    assert ("confidence_prev" in params) == (head == "prev_token")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (4, 33)), jnp.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (4, 32)),
        "segment_ids": jnp.ones((4, 32), jnp.int32),
    }
    anchors = jnp.asarray(rng.integers(0, 31, (4, 4)), jnp.int32)
    kw = dict(drafter=cfg.drafter, target_cfg=tcfg, train=cfg.train, layer_ids=layer_ids)
    before = float(eval_metrics(params, run.params, frozen, batch, anchors, **kw)["conf_bce"])
    opt, step = make_train_step(cfg, tcfg, layer_ids, params)
    state = {"params": params, "opt_state": opt.init(params)}
    for _ in range(30):
        state, _ = step(state, run.params, frozen, batch, anchors)
    after = float(
        eval_metrics(state["params"], run.params, frozen, batch, anchors, **kw)["conf_bce"]
    )
    assert np.isfinite(after) and after < 0.9 * before, (before, after)


def test_a_drafter_json_without_confidence_input_still_loads(target, drafter):
    """Runs saved before the field read as confidence_input="hidden" and still resume."""
    workdir = _copy(drafter, "old_json")
    path = os.path.join(workdir, "drafter.json")
    with open(path) as f:
        record = json.load(f)
    del record["config"]["drafter"]["confidence_input"]
    with open(path, "w") as f:
        json.dump(record, f)
    cfg, _, _ = load_drafter(workdir)
    assert cfg.drafter.confidence_input == "hidden"
    train_drafter(drafter_cfg(), target, workdir, progress=False)  # resumes (finished)


def test_a_checkpoint_of_the_earlier_optimizer_structure_resumes_exactly(target, drafter):
    """Drafter checkpoints written with chain(clip, adamw) (before the drafter used the
    training stack's optimizer) are read and rewrapped: resuming from such a step-4 checkpoint
    ends on the uninterrupted run's params, so no moment was lost or swapped."""
    from v41jax.dspark.model.drafter import frozen_target
    from v41jax.dspark.train.record import load_drafter_config
    from v41jax.dspark.train.state import _legacy_opt_structure, drafter_state_fns
    from v41jax.train.checkpoint import Checkpointer

    final = _leaves(load_drafter(drafter[0])[1])
    workdir = _copy(drafter, "legacy")
    ckpt_dir = os.path.join(workdir, "checkpoints")
    shutil.rmtree(os.path.join(ckpt_dir, "8"))
    os.remove(os.path.join(workdir, "eval.json"))
    cfg, _ = load_drafter_config(workdir)
    run = load_run(target)
    frozen = frozen_target(run.params, run.cfg.model)
    abstract = drafter_state_fns(cfg, run.cfg.model, frozen, run.mesh)[3]
    ckpt = Checkpointer(ckpt_dir, 3)
    state, data = ckpt.restore(4, abstract)
    ckpt.close()
    legacy = _legacy_opt_structure(cfg, abstract["params"])
    opt_state = jax.tree.unflatten(legacy, jax.tree.leaves(state["opt_state"]))
    old = {"params": state["params"], "opt_state": opt_state}
    shutil.rmtree(os.path.join(ckpt_dir, "4"))
    ckpt = Checkpointer(ckpt_dir, 3)
    ckpt.save(4, old, data)
    assert "inner_states" not in json.dumps(ckpt.saved_tree(4)["opt_state"], default=str)
    ckpt.close()
    train_drafter(drafter_cfg(), target, workdir, progress=False)
    again = _leaves(load_drafter(workdir)[1])
    assert all(np.array_equal(a, b) for a, b in zip(final, again, strict=True))


def _cut(path, keep=None):
    """Cut the file at `path` to its first `keep` bytes (default half)."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if keep is None else keep)


def test_a_damaged_drafter_checkpoint_is_named_and_left_in_place(drafter, capsys):
    """load_drafter (generate --drafter) reads as load_run does: checkpoint 8 cut, step 4.

    load_drafter reads the params alone, so the cut must reach them: every array data file
    of step 8 is cut (which of orbax's data files holds the params varies from save to
    save; a cut that reaches only optimizer moments leaves what decoding reads intact)."""
    workdir = _copy(drafter, "damaged")
    state = os.path.join(workdir, "checkpoints", "8", "state")
    data_files = [os.path.join(r, f) for r, _, fs in os.walk(state) for f in fs
                  if os.path.basename(r) == "d"]  # fmt: skip
    assert data_files
    for path in data_files:
        _cut(path)
    before = _snapshot(workdir)
    capsys.readouterr()
    _, params, record = load_drafter(workdir)
    err = capsys.readouterr().err
    assert record["step"] == 4 and "checkpoint 8 in" in err and "using step 4" in err, err
    assert "is damaged" in err and "left in place" in err, err
    step4 = _leaves(load_drafter(drafter[0], step=4)[1])
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), step4, strict=True))
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 8: .* is damaged"):
        load_drafter(workdir, step=8)
    assert _snapshot(workdir) == before  # read-only: nothing renamed


def test_a_drafter_resume_names_the_train_lines_its_log_lacks(target, drafter, capsys):
    """The log cut in step 2's line (log_every=2), resumed at 4: under the run's cadence both
    2 and 4 lack their train line, as `train` would say (the cut line alone names only 2)."""
    workdir = _copy(drafter, "cut_log")
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    os.remove(os.path.join(workdir, "eval.json"))
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        text = f.read()
    _cut(path, text.index('{"step": 2,') + 5)
    capsys.readouterr()
    train_drafter(drafter_cfg(), target, workdir, progress=False)
    assert "steps 2, 4 have no train line" in capsys.readouterr().err
    rows = read_metrics(path)
    assert [r["missing_train_steps"] for r in rows if "log_note" in r] == [[2, 4]]


def test_a_cut_drafter_json_is_named_in_one_line(target, drafter, capsys):
    workdir = _copy(drafter, "cut_json")
    path = os.path.join(workdir, "drafter.json")
    _cut(path)
    before = _snapshot(workdir)
    for argv in (
        ["train-drafter", "--target-workdir", target, "--workdir", workdir, "--no-progress"],
        ["generate", "--workdir", target, "--drafter", workdir, "--max-new-tokens", "2"],
    ):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and path in lines[0] and "cut short" in lines[0], err
    assert _snapshot(workdir) == before


def test_loading_a_drafter_for_decoding_builds_no_optimizer(target, drafter, monkeypatch):
    """load_drafter (generate --drafter, given the loaded target) restores the params alone:
    with every optimizer builder made to fail it still reads the trained params (training
    resumes the whole state)."""
    import optax

    from v41jax.dspark.train import state as drafter_state

    run = load_run(target)
    trained = _leaves(load_drafter(drafter[0], target=run)[1])

    def no_optimizer(*args, **kwargs):
        raise AssertionError("decoding built an optimizer")

    for name in ("make_optimizer", "drafter_optimizer", "_legacy_opt_structure"):
        monkeypatch.setattr(drafter_state, name, no_optimizer)
    monkeypatch.setattr(optax, "adamw", no_optimizer)
    _, params, record = load_drafter(drafter[0], target=run)
    assert record["step"] == 8
    assert all(np.array_equal(a, b) for a, b in zip(trained, _leaves(params), strict=True))


def test_a_drafter_run_writes_its_small_files_on_process_0_only(target, drafter, monkeypatch):
    """Resumed on a process other than 0 (as `Run` sees it), a drafter run saves its
    checkpoint (every process takes part) but writes no drafter.json, log or eval.json."""
    import types

    from v41jax.train import run as run_lib

    workdir = _copy(drafter, "process_1")
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    os.remove(os.path.join(workdir, "eval.json"))
    before = _snapshot(workdir)
    monkeypatch.setattr(run_lib, "jax", types.SimpleNamespace(process_index=lambda: 1))
    result = train_drafter(drafter_cfg(), target, workdir, progress=False)
    assert result["step"] == 8 and os.path.isdir(os.path.join(workdir, "checkpoints", "8"))
    after = _snapshot(workdir)
    assert not os.path.exists(os.path.join(workdir, "eval.json"))
    for name in ("drafter.json", "metrics.jsonl"):
        assert after[name] == before[name]
    assert {n for n in after if n.startswith("tensorboard")} == {
        n for n in before if n.startswith("tensorboard")
    }
