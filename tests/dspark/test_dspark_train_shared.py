"""Several drafters against one frozen-target pass per step (`train_drafters`): each drafter's
params, optimizer state and metrics equal its run alone, a finished drafter is skipped, and
drafters that would see different batches are refused with the field named."""

import json
import os

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.dspark.train.config import DrafterRunConfig, override_run_config
from v41jax.dspark.train.load import load_drafter
from v41jax.dspark.train.loop import train_drafters
from v41jax.train import train

SETTINGS = [
    "drafter.num_layers=1",
    "drafter.block_size=3",
    "drafter.markov_rank=4",
    "drafter.window=16",
    "train.batch_size=8",
    "train.anchors_per_seq=2",
    "train.steps=4",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
]


def cfg(*extra):
    return override_run_config(DrafterRunConfig(), SETTINGS + list(extra))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("target"))
    tcfg = config_lib.override(
        config_lib.get_config("tiny"),
        ["train.steps=4", "train.eval_every=0", "model.max_seq_len=64"],
    )
    train(tcfg, workdir, progress=False)
    return workdir


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def test_shared_pass_equals_each_drafter_alone(target, tmp_path):
    kinds = {
        "dspark": cfg(),
        "mtp1": cfg("drafter.kind=mtp1", "drafter.block_size=1", "drafter.markov_rank=0"),
        "layers": cfg("drafter.target_layer_ids=1,0"),  # other layers, in another order
    }
    alone = {n: str(tmp_path / "alone" / n) for n in kinds}
    for n, c in kinds.items():
        train_drafters({alone[n]: c}, target, progress=False)
    joint = {n: str(tmp_path / "joint" / n) for n in kinds}
    results = train_drafters({joint[n]: c for n, c in kinds.items()}, target, progress=False)
    for n in kinds:
        assert _same(load_drafter(alone[n])[1], load_drafter(joint[n])[1]), n
        assert _metrics(alone[n]) == _metrics(joint[n]), n
        assert results[joint[n]]["step"] == 4
    # a finished drafter returns its evaluation; the new one trains as if alone
    extra = str(tmp_path / "joint" / "second")
    again = train_drafters({joint["dspark"]: kinds["dspark"], extra: cfg("train.seed=0")},
                           target, progress=False)  # fmt: skip
    assert again[joint["dspark"]] == results[joint["dspark"]]
    assert _same(load_drafter(extra)[1], load_drafter(alone["dspark"])[1])


def test_drafters_that_would_see_other_batches_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="train.batch_size"):
        train_drafters(
            {str(tmp_path / "a"): cfg(), str(tmp_path / "b"): cfg("train.batch_size=2")},
            target,
            progress=False,
        )
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
    with pytest.raises(ValueError, match="no drafters"):
        train_drafters({}, target)


def test_too_little_held_out_text_fails_before_the_first_step(target, tmp_path):
    """The validation batches are cut before training: a run asking for more than the
    held-out text holds fails at once, not after its last step (when the final evaluation
    runs and the last checkpoint is not yet written)."""
    workdir = tmp_path / "d"
    with pytest.raises(ValueError, match="validation data has .* but 100000 were requested"):
        train_drafters({str(workdir): cfg("train.eval_batches=100000")}, target, progress=False)
    ckpts = workdir / "checkpoints"
    assert not ckpts.exists() or not any(p.name.isdigit() for p in ckpts.iterdir())
    assert not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl").read_text()


def test_a_signal_stops_every_drafter_at_one_step_and_the_rerun_resumes_exactly(
    target, tmp_path, monkeypatch
):
    """SIGTERM during step 3 (the one step loop, `v41jax.train.steploop`): both drafters save
    step 3 and report it stopped, with no eval.json; the same command then finishes each one
    exactly as an uninterrupted run."""
    import signal

    from v41jax.dspark.train import step as S

    anchors_at = S.anchors_at

    def signal_at_step_3(seed, step, *args):
        if step == 2:  # the anchors of step 3 (steps count from 1)
            os.kill(os.getpid(), signal.SIGTERM)
        return anchors_at(seed, step, *args)

    runs = {str(tmp_path / "a"): cfg(), str(tmp_path / "b"): cfg("train.steps=6")}
    with monkeypatch.context() as m:
        m.setattr(S, "anchors_at", signal_at_step_3)
        stopped = train_drafters(runs, target, progress=False)
    assert all(r == {"step": 3, "stopped": True} for r in stopped.values()), stopped
    for w in runs:
        assert os.path.isdir(os.path.join(w, "checkpoints", "3"))
        assert not os.path.exists(os.path.join(w, "eval.json"))
    done = train_drafters(runs, target, progress=False)
    assert [done[w]["step"] for w in runs] == [4, 6]
    alone = str(tmp_path / "alone")
    train_drafters({alone: cfg()}, target, progress=False)
    assert _same(load_drafter(alone)[1], load_drafter(str(tmp_path / "a"))[1])
    assert _metrics(alone) == _metrics(str(tmp_path / "a"))
