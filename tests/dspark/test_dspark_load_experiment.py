"""experiments/dspark_load: the report's targets, findings and tables from a summary, the
pieces of run.py that turn passes into the `summary["load"]` rows, and (slow) the quick
setting end to end: every decoder at every concurrency, both engines' cost tables, the open
loop, the plots."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXP = os.path.join(ROOT, "experiments", "dspark_load")
DECODERS = ["plain", "fixed_L1", "fixed_L2", "fixed_L3", "fixed_L4", "fixed_L5",
            "scheduled_padded", "scheduled_ragged"]  # fmt: skip
ROW_KEYS = {"decoder", "concurrency", "tokens_per_s", "speedup_vs_plain", "p50_latency_s",
            "p99_latency_s", "mean_verify_len"}  # fmt: skip


def _module(name):
    spec = importlib.util.spec_from_file_location(f"dspark_load_{name}", f"{EXP}/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(speed):
    """A summary whose load rows have tokens/s = speed[decoder][i] at concurrency (1, 64)."""
    rows = []
    for name, per in speed.items():
        for c, tps in zip((1, 64), per, strict=True):
            verify = 0.0 if name == "plain" else 2.5
            rows.append({"decoder": name, "concurrency": c, "tokens_per_s": tps,
                         "speedup_vs_plain": tps / speed["plain"][(1, 64).index(c)],
                         "p50_latency_s": 1.0, "p99_latency_s": 2.0,
                         "mean_verify_len": verify, "acceptance": 0.6})  # fmt: skip
    table = {"tokens": [2, 8], "seconds": [0.01, 0.02]}
    return {
        "setting": "full", "machine": {"cpu": "test cpu"}, "commit": "abc1234",
        "drafter": {"block_size": 5}, "load": rows, "open_loop": [],
        "costs": {c: {"padded": {"tokens": [int(c) * (1 + w) for w in range(6)],
                              "seconds": [0.02 + 0.006 * w for w in range(6)]},
                      "ragged": {"rounds": table, "buckets": [1, 2, 8], "plain_seconds": 0.02}}
                  for c in ("1", "64")},
    }  # fmt: skip


def test_targets_and_findings_read_the_rows():
    report = _module("report")
    speed = {"plain": [40, 200], "fixed_L5": [80, 150], "fixed_L2": [70, 210],
             "scheduled_ragged": [76, 231]}  # fmt: skip
    got = {t["target"]: t for t in report.targets(_summary(speed))}
    assert len(got) == 3 and all(t["met"] for t in got.values())
    worse = report.targets(_summary({**speed, "scheduled_ragged": [60, 215]}))
    assert [t["met"] for t in worse] == [True, False, False]  # 1.5x at c=1; 1.024x L2 at 64
    assert worse[0]["measured"] == "worst 1.075x at concurrency 64"
    assert worse[2]["measured"] == "1.024x fixed_L2"
    found = report.findings(_summary(speed))
    assert found[0] == "fixed L = 5 falls below plain at concurrency 64"
    text = report.render_tables(_summary(speed))
    assert "## Targets" in text and "231.0 (1.16x)" in text and "test cpu" in text
    # the cost table's rate: plain c / 0.02 s; L = 5 at acceptance 0.6: c (1 + 3) / 0.05 s
    eff = {(e["decoder"], e["concurrency"]): e for e in report.loop_efficiency(_summary(speed))}
    assert set(eff) == {(n, c) for n in ("plain", "fixed_L5", "fixed_L2") for c in (1, 64)}
    assert eff[("plain", 1)]["efficiency"] == pytest.approx(40 / 50)
    assert eff[("fixed_L5", 64)]["table_tokens_per_s"] == pytest.approx(64 * 4 / 0.05)
    assert eff[("fixed_L2", 1)]["efficiency"] == pytest.approx(70 / (2.2 / 0.032))
    assert "0.80 (of 50)" in text


def test_best_passes_keep_each_decoders_fastest_pass_and_price_it_against_plains():
    run = _module("run")
    passes = [
        {"decoder": "plain", "concurrency": 4, "tokens_per_s": 10.0, "p50_latency_s": 1.0,
         "p99_latency_s": 2.0, "mean_verify_len": 0.0, "acceptance": 0.0},
        {"decoder": "plain", "concurrency": 4, "tokens_per_s": 12.0, "p50_latency_s": 0.9,
         "p99_latency_s": 1.5, "mean_verify_len": 0.0, "acceptance": 0.0},
        {"decoder": "fixed_L2", "concurrency": 4, "tokens_per_s": 18.0, "p50_latency_s": 0.5,
         "p99_latency_s": 0.7, "mean_verify_len": 2.0, "acceptance": 0.7},
    ]  # fmt: skip
    rows = run.best_passes(passes)
    assert [r["decoder"] for r in rows] == ["plain", "fixed_L2"]
    assert rows[0]["tokens_per_s"] == 12.0 and rows[1]["speedup_vs_plain"] == 1.5
    assert all(ROW_KEYS <= set(r) for r in rows)


def test_ragged_sizes_keep_small_buckets_and_the_largest():
    run = _module("run")
    sizes = run.ragged_sizes(256, 5, 12)
    assert sizes[:7] == (2, 3, 4, 5, 6, 7, 8) and sizes[-1] == 256 * 6 and len(sizes) == 19
    assert run.ragged_sizes(1, 5, 12) == (2, 3, 4, 5, 6)


@pytest.mark.e2e
@pytest.mark.slow
def test_dspark_load_experiment_miniature(tmp_path):
    out = tmp_path / "results"
    script = os.path.join(EXP, "run.py")
    cmd = [sys.executable, script, "--quick", "--runs-dir", str(tmp_path / "runs")]
    subprocess.run(cmd + ["--out-dir", str(out)], check=True, cwd=ROOT, timeout=2400)
    summary = json.loads((out / "summary.json").read_text())
    decoders = summary["settings"]["DECODERS"]
    assert {(r["decoder"], r["concurrency"]) for r in summary["load"]} == {
        (d, c) for d in decoders for c in (1, 3)
    }
    for r in summary["load"]:
        assert ROW_KEYS <= set(r) and r["tokens_per_s"] > 0
        assert r["p99_latency_s"] >= r["p50_latency_s"] > 0
        if r["decoder"] == "plain":
            assert r["speedup_vs_plain"] == 1.0 and r["mean_verify_len"] == 0
    assert {r["decoder"] for r in summary["open_loop"]} == set(decoders)
    assert set(summary["costs"]) == {"1", "3"} and summary["machine"] and summary["commit"]
    assert "## Targets" in (out / "tables.md").read_text()
    for png in ("throughput.png", "speedup.png"):
        assert (out / png).stat().st_size > 0
    # a rerun measures nothing new: every part is in stages.json
    again = subprocess.run(cmd + ["--out-dir", str(out)], cwd=ROOT, timeout=600,
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0 and "pass 0" not in again.stdout


def test_stages_resume_keeps_finished_groups_and_drops_unfinished_ones_from_another_boot(
    tmp_path, monkeypatch
):
    run = _module("run")
    assert run.part_group("closed/c4/pass1/plain") == "closed/c4"
    assert run.part_group("costs/c4") == "closed/c4"
    assert run.part_group("open/0.5/fixed_L2") == "open"
    assert run.part_group("costs/open") == "open"
    complete = {"closed/c1": ["costs/c1", "closed/c1/pass0/plain"],
                "closed/c4": ["costs/c4", "closed/c4/pass0/plain"],
                "open": ["costs/open", "open/0.5/plain"]}  # fmt: skip
    parts = {"costs/c1": {"boot": "old"}, "closed/c1/pass0/plain": {"boot": "old"},  # finished
             "costs/c4": {"boot": "old"},  # unfinished, another boot: dropped
             "costs/open": {"boot": "now"}}  # unfinished, this boot: kept  # fmt: skip
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"settings": {"a": 1}, "parts": parts}))
    monkeypatch.setattr(run, "boot_id", lambda: "now")
    stages = run.Stages(str(path), {"a": 1}, complete)
    assert sorted(stages.parts) == ["closed/c1/pass0/plain", "costs/c1", "costs/open"]
    got = stages.get("costs/c4", lambda: {"x": 2})
    assert got == {"x": 2, "boot": "now"}
    assert json.loads(path.read_text())["parts"]["costs/c4"] == got
    # other settings (e.g. a retrained model's fingerprint): nothing is reused
    assert run.Stages(str(path), {"a": 2}, complete).parts == {}
    path.write_text('{"settings": ')
    with pytest.raises(SystemExit, match="stages.json is damaged"):
        run.Stages(str(path), {"a": 1}, complete)


def test_a_partial_summary_reads_only_finished_groups_and_names_the_rest(tmp_path):
    """`run.py --finished-only`: the finished groups' passes, open-loop runs and cost tables,
    the unfinished groups named (and in tables.md), nothing of an unfinished group used."""
    run, report = _module("run"), _module("report")
    complete = {"closed/c1": ["costs/c1", "closed/c1/pass0/plain", "closed/c1/pass0/fixed_L1"],
                "closed/c4": ["costs/c4", "closed/c4/pass0/plain"],
                "open": ["costs/open", "open/0.5/plain"]}  # fmt: skip
    table = {"tokens": [1, 2], "seconds": [0.01, 0.02]}
    cost = {"padded": table, "ragged": {"rounds": table, "buckets": [1, 2],
                                        "plain_seconds": 0.01}, "boot": "b"}  # fmt: skip

    def row(name, tps):
        return {"decoder": name, "concurrency": 1, "pass": 0, "tokens_per_s": tps,
                "p50_latency_s": 1.0, "p99_latency_s": 1.5, "mean_verify_len": 0.0,
                "acceptance": 0.0, "boot": "b"}  # fmt: skip

    parts = {"costs/c1": cost, "closed/c1/pass0/plain": row("plain", 10.0),
             "closed/c1/pass0/fixed_L1": row("fixed_L1", 15.0),
             "costs/c4": cost}  # c4 unfinished; open not started  # fmt: skip
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"settings": {"a": 1}, "parts": parts}))
    stages = run.Stages(str(path), {"a": 1}, complete)
    rows, open_rows, costs, missing = run.finished_groups(stages, complete)
    assert [r["decoder"] for r in rows] == ["plain", "fixed_L1"] and open_rows == []
    assert list(costs) == [1] and costs[1] == {"padded": table, "ragged": cost["ragged"]}
    assert missing == ["closed/c4", "open"]
    load = run.best_passes(rows)
    assert [(r["decoder"], r["speedup_vs_plain"]) for r in load] == [
        ("plain", 1.0),
        ("fixed_L1", 1.5),
    ]
    summary = {"setting": "full", "machine": {"cpu": "test cpu"}, "commit": "abc",
               "drafter": {"block_size": 5}, "load": load, "open_loop": open_rows,
               "costs": {"1": costs[1]}, "missing_groups": missing}  # fmt: skip
    assert "not measured yet: closed/c4, open" in report.render_tables(summary)
    assert "Partial" not in report.render_tables(summary | {"missing_groups": []})


def test_params_fingerprint_names_the_models_bits():
    import numpy as np

    run = _module("run")
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    same = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    assert run.params_fingerprint(tree) == run.params_fingerprint(same)
    same["b"][1] = 1e-7
    assert run.params_fingerprint(tree) != run.params_fingerprint(same)
    assert run.params_fingerprint(tree) != run.params_fingerprint({**tree, "w": tree["w"].T})


def test_a_timed_run_that_compiled_is_run_again():
    """CompileCounter counts the XLA compilations inside its block; timed_run reruns a
    measurement that compiled (each run compiles what it meets) and gives up after
    COMPILE_RETRIES."""
    import jax
    import jax.numpy as jnp

    from v41jax.bench.common import CompileCounter

    run = _module("run")
    f = jax.jit(lambda x: x * 3 + 1)
    with CompileCounter() as first:
        f(jnp.ones(7))
    with CompileCounter() as again:
        f(jnp.ones(7))
    assert first.count >= 1 and again.count == 0
    sizes = iter(range(100, 200))
    res = run.timed_run(lambda: {"n": float(f(jnp.ones(5)).sum())})  # compiles once, reruns
    assert res["reruns"] == 1 and res["compiles"] == 0 and res["n"] == 20.0
    res = run.timed_run(lambda: {"n": float(f(jnp.ones(next(sizes))).sum())})  # always new
    assert res["reruns"] == run.COMPILE_RETRIES and res["compiles"] >= 1


class _FakeBatcher:
    """A batcher whose requests each finish `steps` steps after they start, one step = one
    second of its clock, `slots` at a time (FIFO): closed_loop's bookkeeping without a model."""

    def __init__(self, slots, steps=3):
        import collections

        self.slots, self.steps, self.t = slots, steps, 0.0
        self.queue, self.running, self.cancelled, self.most_busy = collections.deque(), [], 0, 0

    def submit(self, request):
        self.queue.append((request, self.t))

    @property
    def busy(self):
        return len(self.running)

    @property
    def waiting(self):
        return len(self.queue)

    def step(self):
        from v41jax.decode.batching import Completion

        while self.queue and len(self.running) < self.slots:
            req, when = self.queue.popleft()
            self.running.append([req, when, self.t, 0])
        self.most_busy = max(self.most_busy, len(self.running))
        self.t += 1.0
        out, keep = [], []
        for r in self.running:
            r[3] += 1
            if r[3] == self.steps:
                tokens = np.zeros(r[0].max_new_tokens, np.int32)
                out.append(Completion(r[0].request_id, tokens, 3, 6, 3, r[1], r[2], self.t))
            else:
                keep.append(r)
        self.running = keep
        return out

    def cancel(self):
        dropped = len(self.queue) + len(self.running)
        self.queue.clear()
        self.running = []
        self.cancelled += dropped
        return dropped


def test_the_closed_loop_keeps_c_in_flight_and_measures_the_steady_state():
    """closed_loop: the batch never drains (every slot busy until the end), the n requests
    after the first c are measured from the c-th completion to the last, and the c still in
    flight are cancelled. With every request 3 steps long at c slots: c requests per 3 s."""
    run = _module("run")
    prompts = np.ones((5, 4), np.int32)
    for c, n in ((1, 4), (4, 8), (4, 6)):
        b = _FakeBatcher(c)
        res = run.closed_loop(b, prompts, n, c)
        assert res["requests"] == n and b.most_busy == c and b.cancelled == c
        assert b.busy == 0 and b.waiting == 0
        new_tokens = run.C.NEW_TOKENS
        # waves of c requests every 3 s: n requests after the first wave take 3 n / c s
        assert res["wall_s"] == pytest.approx(3.0 * -(-n // c))
        assert res["tokens"] == n * new_tokens
        assert res["p50_latency_s"] == pytest.approx(3.0)  # submitted as its slot freed
