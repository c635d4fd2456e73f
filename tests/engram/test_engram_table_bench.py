"""The table-size benchmark runs end to end at toy sizes, writes its JSON rows, reports the
optimizer-state bytes of each optimizer, and skips sizes that would not fit in memory."""

import json

import pytest

from v41jax.bench.table_bench import main


@pytest.mark.slow  # four compiled train steps; the optimizers themselves are tested fast
def test_table_bench_rows_state_bytes_and_skips(tmp_path):
    path = tmp_path / "tables.json"
    argv = ["--sizes", "1e5,1e13", "--optimizers", "adam,rowwise_adagrad", "--steps", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    rows = {r["optimizer"]: r for r in out["rows"]}
    assert sorted(rows) == ["adam", "rowwise_adagrad"]
    for r in rows.values():
        assert r["s_per_step"] > 0 and r["vs_smallest"] == 1.0 and r["table_params"] >= 1e5
    # dense Adam keeps two moments of the table; row-wise Adagrad one float per 16-wide row
    adam, adagrad = rows["adam"], rows["rowwise_adagrad"]
    assert abs(adam["opt_state_MiB"] - 2 * adam["table_MiB"]) < 1e-6
    assert abs(adagrad["opt_state_MiB"] - adagrad["table_MiB"] / 16) < 1e-6
    assert {(s["optimizer"], s["size"]) for s in out["skipped"]} == {
        ("adam", 1e13),
        ("rowwise_adagrad", 1e13),
    }
