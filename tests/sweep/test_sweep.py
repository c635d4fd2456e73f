"""Sweeps: a toy grid runs, is skipped when finished, continues after a kill; the report
rebuilds summary.json, tables and plots from the run dirs; Engram-off surgery; token types."""

import collections
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.config import ModelConfig
from v41jax.data import CompressionTable
from v41jax.engram import EngramConfig, ngram_hash_ids_np
from v41jax.model import Transformer, engram_ids_key
from v41jax.sweep import RunSpec, load_sweep, run_sweep
from v41jax.sweep.analysis import (
    BigramCounts,
    engram_off_params,
    model_logits,
    previous_ids,
    strip_engram,
    token_type_masks,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOY_SWEEP = textwrap.dedent(
    """
    import dataclasses
    from v41jax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
    from v41jax.engram import EngramConfig
    from v41jax.sweep import RunSpec

    SETTINGS = ("toy",)
    BASE = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2,
                       d_ff=64, max_seq_len=32)
    ENGRAM = EngramConfig(layer_ids=(0,), engram_vocab_size=(101, 103), n_embed_per_ngram=8,
                          n_head_per_ngram=2, table_row_align=8)
    ARMS = {
        "baseline": (BASE, {"kind": "baseline", "p_added": 0}, ("token_split",)),
        "engram_s": (dataclasses.replace(BASE, engram=ENGRAM),
                     {"kind": "engram", "p_added": 2500, "p_index": 0}, ("engram_off",)),
        "ffn_s": (dataclasses.replace(BASE, d_ff=90),
                  {"kind": "ffn", "p_added": 2496, "p_index": 0}, ("token_split",)),
    }

    def get_sweep(setting="toy"):
        return [
            RunSpec("quality", arm, 0, Config(
                name=arm,
                data=DataConfig(vocab_size=512, seq_len=32, global_batch_size=8,
                                max_documents=24),
                model=model,
                optim=OptimConfig(warmup_steps=1),
                train=TrainConfig(steps=4, log_every=1, eval_every=0, eval_batches=2,
                                  checkpoint_every=2)),
                eval_only_analysis=analysis, meta=meta)
            for arm, (model, meta, analysis) in ARMS.items()
        ]
    """
)


def _files_state(workdir):
    """mtime of every file under workdir: unchanged means nothing was retrained or rewritten."""
    out = {}
    for root, _, files in os.walk(workdir):
        for f in files:
            path = os.path.join(root, f)
            out[path] = os.stat(path).st_mtime_ns
    return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweep")
    path = base / "toy_sweep.py"
    path.write_text(TOY_SWEEP)
    return str(path), str(base / "runs")


def test_sweep_limit_skip_kill_and_report(toy, tmp_path, capsys):
    path, runs = toy
    specs = load_sweep(path, "toy")
    first = run_sweep(specs, runs, progress=False, limit=2)
    assert first["trained"] == ["quality/baseline_seed0", "quality/engram_s_seed0"]
    assert first["pending"] == ["quality/ffn_s_seed0"] and not first["stopped"]
    second = run_sweep(specs, runs, progress=False)
    assert second["skipped"] == first["trained"] and second["trained"] == ["quality/ffn_s_seed0"]
    for spec in specs:
        result = json.load(open(os.path.join(spec.workdir(runs), "result.json")))
        assert result["tokens_seen"] == 4 * 8 * 32 and result["step"] == 4
        assert result["wall_s"] > 0 and result["accounting"]["total_params"] > 0
        assert os.path.exists(os.path.join(spec.workdir(runs), "done.json"))
    # engram_off / token_split ran right after training
    engram_dir = specs[1].workdir(runs)
    assert os.path.exists(os.path.join(engram_dir, "analysis_engram_off.json"))

    before = _files_state(runs)
    assert main(["sweep", path, "--setting", "toy", "--runs-dir", runs, "--no-progress"]) == 0
    after = _files_state(runs)
    assert after.pop(os.path.join(runs, "sweep.json")) and after == before  # all skipped
    with open(os.path.join(runs, "sweep.json")) as f:
        assert json.load(f) == {"sweep_file": "toy_sweep.py", "setting": "toy"}
    assert main(["sweep", path, "--setting", "toy", "--runs-dir", runs, "--list"]) == 0
    assert capsys.readouterr().out.count("done    ") == 3

    # A kill after step 2's checkpoint: no final checkpoint, no done marker. The rerun trains
    # steps 3-4 again and, by exact resume, reaches the same validation loss.
    base_dir = specs[0].workdir(runs)
    old = json.load(open(os.path.join(base_dir, "result.json")))
    shutil.rmtree(os.path.join(base_dir, "checkpoints", "4"))
    os.remove(os.path.join(base_dir, "done.json"))
    third = run_sweep(specs, runs, progress=False)
    assert third["trained"] == ["quality/baseline_seed0"] and len(third["skipped"]) == 2
    new = json.load(open(os.path.join(base_dir, "result.json")))
    assert new["val_loss"] == pytest.approx(old["val_loss"], abs=1e-6)
    with open(os.path.join(base_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
    assert steps == [1, 2, 3, 4]  # one clean history; the killed lines are moved aside

    # The report needs only the run dirs (the experiment folder holds no sweep file).
    exp = tmp_path / "exp"
    exp.mkdir()
    # The toy setting is not "full": its report goes next to its runs, not into exp/results.
    assert main(["report", str(exp), "--runs-dir", runs, "--quiet"]) == 0
    assert not (exp / "results").exists()
    results = Path(runs) / "results"
    summary = json.load(open(results / "summary.json"))
    assert {r["setting"] for r in summary} == {"toy"}
    required = {"study", "arm", "seed", "total_params", "active_params", "flops_per_token"}
    required |= {"engram_params", "val_loss", "tokens_seen", "wall_s"}
    assert len(summary) == 3 and all(required <= set(r) for r in summary)
    by_arm = {r["arm"]: r for r in summary}
    assert by_arm["engram_s"]["engram_params"] > 0 == by_arm["ffn_s"]["engram_params"]
    tables = (results / "tables.md").read_text()
    assert "| baseline | baseline |" in tables and "Best Engram model" in tables
    pngs = sorted(p.name for p in results.glob("*.png"))
    assert pngs == [f"quality_{n}.png" for n in ("loss_vs_flops", "loss_vs_params", "step_time")]
    study3 = json.load(open(results / "study3.json"))
    assert study3["best"]["check_max_abs_logit_diff"] < 1e-5
    assert set(study3["compare"]) == {"baseline", "ffn"}
    overall = study3["best"]["groups"]["all"]["all"]
    engram_result = json.load(open(os.path.join(engram_dir, "result.json")))
    assert overall["loss"] == pytest.approx(engram_result["val_loss"], rel=1e-5)  # same batches


def test_sweep_errors_name_the_value(toy, tmp_path):
    path, _ = toy
    with pytest.raises(ValueError, match="unknown setting 'huge'"):
        load_sweep(path, "huge")
    spec = load_sweep(path, "toy")[0]
    with pytest.raises(ValueError, match="cfg.train.seed=0 != seed=3"):
        RunSpec(spec.study, spec.arm, 3, spec.cfg)
    with pytest.raises(ValueError, match="eval_only_analysis \\['nope'\\]"):
        RunSpec(spec.study, spec.arm, 0, spec.cfg, eval_only_analysis=("nope",))
    with pytest.raises(ValueError, match="RunSpec.arm='a/b'"):
        RunSpec(spec.study, "a/b", 0, spec.cfg)
    assert main(["sweep", str(tmp_path / "missing.py")]) == 2
    # a finished run trained with another config is never silently reused
    workdir = spec.workdir(str(tmp_path / "runs"))
    os.makedirs(workdir)
    config_lib.save_json(spec.cfg, os.path.join(workdir, "config.json"))
    open(os.path.join(workdir, "done.json"), "w").write("{}")
    changed = load_sweep(path, "toy", ["optim.lr=0.01"])
    with pytest.raises(ValueError, match="quality/baseline_seed0 .*optim.lr: 0.003 -> 0.01"):
        run_sweep(changed[:1], str(tmp_path / "runs"), progress=False)


def _engram_model(use_short_conv):
    engram = EngramConfig(
        layer_ids=(0, 2),
        engram_vocab_size=(53, 59),
        n_embed_per_ngram=8,
        n_head_per_ngram=2,
        compressed_vocab_size=40,
        table_row_align=8,
        use_short_conv=use_short_conv,
    )
    cfg = ModelConfig(
        vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48,
        max_seq_len=16, engram=engram,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    compression = rng.integers(0, 40, 64)
    tokens = rng.integers(0, 64, (2, 12)).astype(np.int32)
    segments = np.repeat([[0] * 5 + [1] * 7], 2, axis=0).astype(np.int32)
    batch = {
        "inputs": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "positions": np.tile(np.arange(12, dtype=np.int32), (2, 1)),
        "segment_ids": segments,
    }
    for layer in engram.layer_ids:
        ids = ngram_hash_ids_np(compression[tokens], layer, engram, segment_ids=segments)
        batch[engram_ids_key(layer)] = ids.astype(np.int32)
    extras = {k: v for k, v in batch.items() if k.startswith("engram_ids")}
    params = Transformer(cfg).init(jax.random.PRNGKey(1), tokens, extras=extras)["params"]
    # a trained-looking conv (the init is zero, which would hide a conv path left on)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "conv_kernel" in str(p) else x, params
    )
    return cfg, params, batch


@pytest.mark.parametrize("use_short_conv", [False, True])
def test_engram_off_equals_model_without_engram(use_short_conv):
    cfg, params, batch = _engram_model(use_short_conv)
    on = model_logits(cfg, jax.device_get(params), batch)
    off = model_logits(cfg, engram_off_params(params), batch)
    stripped, plain_cfg = strip_engram(params, cfg)
    assert not plain_cfg.engram.enabled and "engram" not in str(jax.tree.structure(stripped))
    plain = model_logits(plain_cfg, stripped, batch)
    np.testing.assert_allclose(np.asarray(off), np.asarray(plain), atol=1e-6, rtol=0)
    assert float(np.abs(np.asarray(on) - np.asarray(plain)).max()) > 1e-4  # Engram mattered
    with pytest.raises(ValueError, match="no Engram module"):
        engram_off_params(stripped)


def test_token_types_partition_every_scored_token():
    rng = np.random.default_rng(0)
    v, pad = 30, 0  # 900 possible bigrams, 400 tokens: many never seen
    # a frequent bigram (1, 2) in front of noise
    stream = np.concatenate([np.tile([1, 2], 150), rng.integers(0, v, 400)])
    stream_segments = np.repeat(np.arange(7), 100)
    counts = BigramCounts.from_stream(stream, stream_segments, pad, v)
    prev = previous_ids(stream, stream_segments, pad)
    assert prev[0] == pad and prev[300] == pad and prev[301] == stream[300]
    expected = collections.Counter(zip(prev.tolist(), stream.tolist(), strict=True))
    probe = rng.integers(0, v, (2, 200))
    got = counts.lookup(probe[0], probe[1])
    want = [expected.get((a, b), 0) for a, b in zip(*probe.tolist(), strict=True)]
    assert got.tolist() == want and 0 in want and max(want) > 1
    # a batch with a document boundary, masked tokens, identity compression
    inputs = rng.integers(0, v, (3, 40))
    inputs[:, 20:24] = [1, 2, 1, 2]
    batch = {
        "inputs": inputs,
        "targets": rng.integers(0, v, (3, 40)),
        "segment_ids": np.repeat([[0] * 13 + [1] * 27], 3, axis=0),
        "loss_mask": rng.random((3, 40)) > 0.2,
    }
    words = (rng.random(v) > 0.5, rng.random(v) > 0.5)
    identity = CompressionTable(np.arange(v, dtype=np.int32), v)
    masks = token_type_masks(batch, identity, counts, words, pad)
    for group, buckets in masks.items():
        stacked = np.stack(list(buckets.values())).astype(int)
        assert (stacked.sum(0) == batch["loss_mask"]).all(), group  # disjoint and complete
    assert set(masks) == {"all", "context_bigram", "word"}
    assert masks["context_bigram"]["frequent"].any() and masks["word"]["continuation"].any()


@pytest.mark.e2e
@pytest.mark.slow
def test_mini_setting_end_to_end(tmp_path):
    """The experiment's `mini` setting: every study in miniature, then the report."""
    runs, exp = str(tmp_path / "runs"), tmp_path / "exp"
    exp.mkdir()
    config = os.path.join(ROOT, "experiments", "engram_vs_ffn", "config.py")
    cmd = [sys.executable, "-m", "v41jax"]
    sweep = [*cmd, "sweep", config, "--setting", "mini", "--runs-dir", runs, "--no-progress"]
    out = subprocess.run(sweep, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = [*cmd, "report", str(exp), "--runs-dir", runs, "--out-dir", str(exp / "results")]
    out = subprocess.run(report, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.load(open(exp / "results" / "summary.json"))
    specs = load_sweep(config, "mini")
    assert sorted((r["study"], r["arm"], r["seed"]) for r in summary) == sorted(
        (s.study, s.arm, s.seed) for s in specs
    )
    for r in summary:
        assert np.isfinite(r["val_loss"]) and r["tokens_seen"] == 30 * 8 * 64
        assert r["total_params"] >= r["active_params"] > 0 and r["flops_per_token"] > 0
    alloc = {r["meta"]["rho"]: r for r in summary if r["study"] == "allocation"}
    assert sorted(alloc) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert alloc[1.0]["engram_params"] == 0 < alloc[0.0]["engram_params"]
    quality = [r for r in summary if r["study"] == "quality_per_param"]
    for p in {r["meta"]["p_index"] for r in quality if "p_index" in r["meta"]}:
        engram, ffn = (
            next(r for r in quality if r["meta"].get("p_index") == p and r["meta"]["kind"] == k)
            for k in ("engram", "ffn")
        )
        assert abs(engram["total_params"] - ffn["total_params"]) <= 0.02 * engram["engram_params"]
    assert "what the memory holds" in out.stdout
    assert len(list((exp / "results").glob("*.png"))) == 4
