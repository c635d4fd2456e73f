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


def test_width_row_takes_the_marginal_of_a_layer_and_splits_it_by_part():
    """Added bytes per token per sub-layer: whole step at L, and (added at 2L - added at L)
    over the extra sub-layers; the parts the same way; the bound is forward + backward."""
    from v41jax.bench.mhc_train_bench import width_row
    from v41jax.kernels.hlo_bytes import PARTS
    from v41jax.kernels.mhc_single_pass.backward import backward_bound_bytes

    tokens, d = 100, 64
    cost = lambda b: {"bytes_accessed_per_device": b, "flops_per_device": 1.0}  # noqa: E731
    per_token = {("plain", 2): 1000.0, ("single_pass", 2): 9000.0,
                 ("plain", 4): 2000.0, ("single_pass", 4): 14000.0}  # fmt: skip
    costs = {key: cost(b * tokens) for key, b in per_token.items()}
    zero = dict.fromkeys(PARTS, 0)
    parts = {key: dict(zero) for key in costs}
    parts["single_pass", 2]["mhc_kernels"] = 400 * tokens
    parts["single_pass", 4]["mhc_kernels"] = 2000 * tokens
    row = width_row(d, costs, parts, (2, 4), tokens)
    assert row["added_bytes_per_token_sublayer"] == 8000 / 4  # 8000 B/token over 4 sub-layers
    assert row["marginal_bytes_per_token_sublayer"] == (12000 - 8000) / 4
    assert row["marginal_by_part"]["mhc_kernels"] == (2000 - 400) / 4
    assert row["marginal_by_part"]["compiler_inserted"] == 0
    bound = 10 * d * 4 + backward_bound_bytes(4, d, 24, 4, 4, True)
    assert row["bound_per_token_sublayer"] == bound
    assert row["marginal_over_bound"] == row["marginal_bytes_per_token_sublayer"] / bound
