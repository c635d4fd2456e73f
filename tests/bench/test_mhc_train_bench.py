"""`python -m v41jax.bench mhc_train`: the CPU part times every form side by side and writes
one row per (width, form); bad widths and parts are refused by name. (The TPU part compiles
for a chip: it runs in the aot venv, `python -m v41jax.bench mhc_train --parts tpu`.)"""

import json

import pytest

from v41jax.bench.__main__ import main as bench_main
from v41jax.bench.mhc_train_bench import FORMS


def test_cpu_part_writes_a_row_per_width_and_form(tmp_path):
    out = tmp_path / "mhc_train.json"
    argv = ["mhc_train", "--widths", "64", "--layers", "1", "--batch", "8", "--seq", "16",
            "--passes", "2", "--parts", "cpu", "--json", str(out)]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["cpu"]
    assert [(r["d_model"], r["form"]) for r in rows] == [(64, f) for f in FORMS]
    plain = rows[0]
    assert plain["overhead"] == 0.0 and plain["step_s"] > 0
    assert all(r["step_s"] > 0 and r["passes"] == 2 for r in rows)
    assert "tpu" not in result and result["n_streams"] == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--widths", "100"], "each must be a positive multiple of 64"),
        (["--widths", "2k"], "expected comma-separated integers"),
        (["--parts", "gpu"], "unknown \\['gpu'\\]"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_main(["mhc_train", *argv])
