"""The memory planner (`python -m v41jax plan`, v41jax.train.plan) on the tiny config.

Its byte counts must agree with the compiled memory analysis and with the parameter count
of `v41jax.model.accounting`; a mesh that does not split the batch, an unknown platform or
mesh axis are errors naming the value; a budget smaller than the step is reported as not
fitting. The 1b and 8b configs are only built abstractly here (their plans take minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from v41jax import config as config_lib
from v41jax.model.accounting import param_accounting
from v41jax.train.plan import matmul_flops, parse_bytes, parse_mesh, plan
from v41jax.train.plan_cli import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PLANS: dict = {}


def _tiny_plan(**mesh) -> dict:
    """plan() of tiny on `mesh` (missing axes 1), without the target lowering; cached."""
    key = tuple(sorted(mesh.items()))
    if key not in _PLANS:
        axes = {"data": 1, "fsdp": 1, "tensor": 1} | mesh
        _PLANS[key] = plan(config_lib.get_config("tiny"), axes, "tpu", lower_target=False)
    return _PLANS[key]


def test_bytes_agree_with_compiled_memory_and_param_count():
    r = _tiny_plan(data=2)  # params replicated: every device holds all of them
    b, mem = r["bytes_per_device"], r["compiled_memory"]
    total = param_accounting(config_lib.get_config("tiny").model)["total_params"]
    assert b["params"] == 4 * total  # float32 params
    # Adam: two moments the size of the params, plus step counts (a few int32 scalars)
    assert 0 <= b["optimizer_state"] - 2 * b["params"] < 1024
    assert mem["argument_size_in_bytes"] == b["arguments"]
    assert b["arguments"] == b["params"] + b["optimizer_state"] + b["step_and_rng"] + b["batch"]
    # the batch: 4 int32 and 1 float32 [B/2, T] arrays per device
    assert b["batch"] == 5 * 4 * (8 // 2) * 64
    # the donated state comes back in place: outputs alias the whole state
    assert b["aliased"] == b["params"] + b["optimizer_state"] + b["step_and_rng"]
    assert b["peak"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temporaries"]
    assert r["fits"] and b["temporaries"] > 0


def test_fsdp_splits_params_and_moments():
    r, one = _tiny_plan(fsdp=4), _tiny_plan(data=2)
    total = 4 * param_accounting(config_lib.get_config("tiny").model)["total_params"]
    cfg = config_lib.get_config("tiny").model
    norms = 4 * cfg.d_model * (2 * cfg.num_layers + 1)  # RMSNorm scales are replicated
    assert total / 4 <= r["bytes_per_device"]["params"] <= total / 4 + norms
    assert r["bytes_per_device"]["optimizer_state"] < one["bytes_per_device"]["optimizer_state"]
    assert r["compiled_memory"]["argument_size_in_bytes"] == r["bytes_per_device"]["arguments"]


def test_flops_agree_with_the_model_count():
    r = _tiny_plan(data=2)
    f = r["flops"]
    # no remat: the program's matmuls are the model's 6 N + attention, up to the attention
    # blocks' masking and the loss (within 5%)
    assert f["program_matmul_global"] == pytest.approx(f["model_global"], rel=0.05)
    assert f["program_matmul_per_device"] == f["program_matmul_global"] / 2
    assert f["xla_cost_analysis_per_device"] > 0
    assert 0.9 < r["mfu_bound"] <= 1.05


def test_matmul_flops_counts_scan_bodies():
    a, b = jnp.ones((3, 4)), jnp.ones((4, 5))
    assert matmul_flops(jax.make_jaxpr(jnp.dot)(a, b)) == (2 * 3 * 4 * 5, 0)

    def scanned(a, b):
        return jax.lax.scan(lambda c, _: (c, c @ b), a, None, length=7)[1]

    assert matmul_flops(jax.make_jaxpr(scanned)(a, b))[0] == 7 * 2 * 3 * 4 * 5


def test_mesh_that_does_not_split_the_batch_is_an_error():
    with pytest.raises(ValueError, match=r"global_batch_size=8 .* data x fsdp = 3"):
        plan(config_lib.get_config("tiny"), parse_mesh("data=3"), "tpu", lower_target=False)


def test_bad_platform_and_mesh_are_errors(capsys):
    with pytest.raises(ValueError, match="'rocm'"):
        plan(config_lib.get_config("tiny"), parse_mesh("data=2"), "rocm")
    with pytest.raises(ValueError, match="'pipe=2'"):
        parse_mesh("data=1,pipe=2")
    with pytest.raises(ValueError, match="'16 furlongs'"):
        parse_bytes("16 furlongs")
    assert parse_bytes("16GiB") == 16 << 30 and parse_bytes("1.5e9") == 1_500_000_000
    assert plan_main(["plan", "--config", "tiny", "--mesh", "data=2", "--platform", "x"]) == 2
    assert "--platform 'x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--platform", "cuda", "--topology", "v5e:2x4"], "--topology 'v5e:2x4' is a TPU slice"),
        (["--platform", "tpu", "--topology", "v9:2x4"], "--topology 'v9:2x4': expected"),
        (["--platform", "tpu", "--topology", "v5e"], "--topology 'v5e': expected"),
        (["--platform", "tpu", "--gpu", "h100"], "--gpu 'h100' is a CUDA device"),
        (["--platform", "cuda", "--gpu", "a100"], "--gpu 'a100': known GPU target configs"),
        (["--topology", "v5e:2x4", "--gpu", "h100"], "give one (TPU or CUDA)"),
    ],
)
def test_bad_compile_targets_are_named_before_anything_compiles(extra, message, capsys):
    argv = ["plan", "--config", "tiny", "--mesh", "data=8", *extra]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_target_compiler_is_one_line(capsys, monkeypatch):
    """Without the aot extra (libtpu / the CUDA plugin), --topology and --gpu say what to
    install, in one line, before the CPU compile."""
    from v41jax.kernels import aot

    monkeypatch.setattr(aot, "missing_tpu_compiler", lambda: "libtpu is not installed (x)")
    monkeypatch.setattr(aot, "missing_cuda_compiler", lambda: "no CUDA plugin (y)")
    argv = ["plan", "--config", "tiny", "--mesh", "data=8"]
    assert plan_main([*argv, "--topology", "v5e:2x4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --topology: libtpu is not installed (x)"
    assert plan_main([*argv, "--platform", "cuda", "--gpu", "h100"]) == 2
    assert capsys.readouterr().err.strip() == "error: --gpu: no CUDA plugin (y)"


def test_cli_reports_not_fitting_a_tiny_device(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", "tiny", "--mesh", "data=2", "--device-memory", "1MiB"]
    assert plan_main([*argv, "--no-lower", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| fits" in text and "NO (headroom -" in text and "XLA:CPU compile" in text
    r = json.loads(out.read_text())
    assert r["fits"] is False and r["device_memory"] == 1 << 20
    assert r["bytes_per_device"] == _tiny_plan(data=2)["bytes_per_device"]


def test_target_lowering_is_reported():
    cfg = config_lib.get_config("tiny")
    r = plan(cfg, parse_mesh("data=1"), "cuda")
    assert r["target_lowering"]["ok"], r["target_lowering"]


@pytest.mark.slow
def test_cli_starts_itself_with_enough_devices(tmp_path):
    """16 devices > this process's 8: the command runs again in a child with 16."""
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", "tiny", "--mesh", "data=16", "--no-lower", "--json", str(out)]
    argv += ["--set", "data.global_batch_size=16"]
    assert plan_main(argv) == 0
    assert json.loads(out.read_text())["devices"] == 16


@pytest.mark.e2e
@pytest.mark.slow
def test_python_m_v41jax_plan(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "v41jax", "plan", "--config", "tiny", "--mesh", "fsdp=2"]
    cmd += ["--platform", "cuda", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["devices"] == 2 and r["target_lowering"]["ok"], r["target_lowering"]
    assert r["settings"]["microbatches"] == 1 and "| fits" in run.stdout


@pytest.mark.parametrize(
    "name,low,high",
    [
        ("1b", 1.2e9, 1.3e9),
        ("8b", 7.9e9, 8.1e9),
        ("1b-engram", 1.7e9, 1.9e9),
        ("1b-mhc", 1.2e9, 1.3e9),
        ("8b-engram", 10.5e9, 11e9),
        ("8b-mhc", 7.9e9, 8.1e9),
    ],
)
def test_named_configs_have_the_sizes_their_names_say(name, low, high):
    cfg = config_lib.get_config(name)
    assert cfg.name == name and cfg.model.num_kv_heads < cfg.model.num_heads  # GQA
    total = param_accounting(cfg.model)["total_params"]  # jax.eval_shape: nothing allocated
    assert low <= total <= high, f"{name}: {total:,} params"


@pytest.mark.e2e
def test_readme_table_is_the_committed_plans():
    """docs/launching.md (the manual's launch page) shows experiments/plan/table.py's
    rendering of the committed plan JSONs, verbatim."""
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "plan", "table.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    with open(os.path.join(ROOT, "docs", "launching.md")) as f:
        readme = f.read()
    assert run.stdout.strip() in readme
    for name in ("1b_tpu", "8b_cuda"):  # the two full tables
        with open(os.path.join(ROOT, "experiments", "plan", f"{name}.txt")) as f:
            assert f.read().strip() in readme, name


def test_a_target_the_compiler_refuses_is_a_verdict_not_a_crash():
    """libtpu refuses a step whose temporaries exceed the chip's HBM (RESOURCE_EXHAUSTED):
    the plan's table and the README table say so, with the compiler's figure."""
    from v41jax.train.plan_cli import format_plan

    r = dict(_tiny_plan(data=2))
    error = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (20.19G) exceeds available HBM (15.75G)."
    )
    r["target_compile"] = {
        "platform": "tpu", "target": "v5e:2x4", "chip": "TPU v5e", "devices": 8,
        "memory": {}, "peak_bytes": None, "device_memory": 15 << 30, "fits": False,
        "headroom_bytes": None, "flops_per_device": None, "pallas_kernels": None,
        "compile_seconds": 1.0, "compiler_error": error,
    }  # fmt: skip
    text = format_plan(r)
    assert "NO (the compiler refused it: RESOURCE_EXHAUSTED" in text
    sys.path.insert(0, os.path.join(ROOT, "experiments", "plan"))
    try:
        import table
    finally:
        sys.path.pop(0)
    assert "20.19G (refused)" in table.row_of(r, "x") and "the compiler refuses it" in table.row_of(
        r, "x"
    )
