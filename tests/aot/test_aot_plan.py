"""`python -m v41jax plan --topology / --gpu`: the train step compiled for the chip, its
figures beside the CPU estimate (tiny config: seconds per compile)."""

import json

import pytest

from v41jax.train.plan_cli import main as plan_main
from v41jax.train.plan_target import TARGET_CHIPS


@pytest.mark.parametrize(
    "target, chip",
    [
        (["--platform", "tpu", "--topology", "v5e:2x4"], "v5e"),
        (["--platform", "cuda", "--gpu", "h200"], "h200"),
    ],
)
def test_plan_compiles_for_the_chip(target, chip, tmp_path, capsys, request):
    request.getfixturevalue("tpu_v5e" if chip == "v5e" else "cuda_h100")  # skips without
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", "tiny", "--mesh", "data=1,fsdp=8,tensor=1", "--no-lower"]
    assert plan_main([*argv, *target, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    t = r["target_compile"]
    name = TARGET_CHIPS[chip].name
    assert f"compiled for 8 x {name}" in text and "CPU estimate" in text
    assert t["chip"] == name and t["devices"] == 8 and t["fits"]
    # the CPU estimate is judged against the same chip
    assert r["device_memory"] == t["device_memory"] == TARGET_CHIPS[chip].memory
    assert t["peak_bytes"] == (
        t["memory"]["argument_size_in_bytes"]
        + t["memory"]["output_size_in_bytes"]
        - t["memory"]["alias_size_in_bytes"]
        + t["memory"]["temp_size_in_bytes"]
        + t["memory"]["generated_code_size_in_bytes"]
    )
    if chip == "v5e":  # tiny's splash attention (forward, dq, dkv) per layer
        assert t["pallas_kernels"] >= 3 and t["flops_per_device"] > 0
