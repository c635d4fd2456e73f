"""scripts/device_check.sh on a machine without an accelerator, and the driver's parts.

The script itself runs only its plan here (JAX_PLATFORMS=cpu): it must exit 0 and list every
stage without running one. The driver's pieces (benchmark flags, wheel choice, the runner's
timeout, the report) are tested with stand-in commands, so nothing here needs a GPU/TPU.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def _script_module(name: str):
    """scripts/<name>.py imported as the script sees it: by its bare name (device_check
    imports `device_env` from its own folder)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


device_env = _script_module("device_env")
dc = _script_module("device_check")
SCRIPT = os.path.join(device_env.ROOT, "scripts", "device_check.sh")
STAGES = [
    "kernel_tests", "train", "bench_mhc", "bench_engram", "bench_verify", "bench_attention",
    "bench_host_decode",
]  # fmt: skip


def _script(*args, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("V41JAX_PYTHON", "VIRTUAL_ENV")}
    env.update(JAX_PLATFORMS="cpu", **env_overrides)
    return subprocess.run(
        ["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_script_on_cpu_prints_the_plan_and_exits_0(tmp_path):
    r = _script(V41JAX_PYTHON=sys.executable, OUT=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "no GPU/TPU backend: nothing run" in r.stdout
    assert f"python: {sys.executable}" in r.stdout and "V41JAX_PYTHON is set" in r.stdout
    planned = [line.split()[0] for line in r.stdout.splitlines() if "timeout" in line]
    assert planned == STAGES
    assert "-m pytest tests/kernels -k compiled -p no:randomly" in r.stdout
    assert "train --config tiny --set train.steps=20" in r.stdout
    assert f"report -> {tmp_path / 'device_check.json'}" in r.stdout
    assert not os.listdir(tmp_path)  # a plan writes no report


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the tests run outside a virtualenv")
def test_script_uses_the_active_virtualenv():
    r = _script("--dry-run", VIRTUAL_ENV=sys.prefix)
    assert r.returncode == 0, r.stderr
    assert f"the active virtualenv {sys.prefix}" in r.stdout


def test_script_rejects_a_missing_python_and_an_unknown_stage():
    r = _script(V41JAX_PYTHON="/nonexistent/python3")
    assert r.returncode == 2 and "/nonexistent/python3" in r.stderr
    r = _script("--stages", "train,bogus", V41JAX_PYTHON=sys.executable)
    assert r.returncode != 0 and "unknown stages ['bogus']" in r.stderr


def test_bench_args_prefer_quick_and_keep_only_listed_flags():
    assert dc.bench_args("mhc", "  --quick  small sizes\n  --json JSON", "b.json") == [
        "--quick",
        "--json",
        "b.json",
    ]
    help_text = "  --tokens TOKENS\n  --iters ITERS\n  --json JSON"  # no --rounds, no --quick
    assert dc.bench_args("mhc", help_text, "b.json") == [
        "--tokens",
        "4096",
        "--iters",
        "5",
        "--json",
        "b.json",
    ]
    assert dc.bench_args("attention", "  --length L", "b.json") == []


def test_select_wheels_installs_only_missing_compatible_distributions(tmp_path):
    for name in (
        "pytest-9.2.0-py3-none-any.whl",  # installed here: the present one wins
        "v41jax_absent_pkg-0.10-py3-none-any.whl",
        "v41jax_absent_pkg-0.9-py3-none-any.whl",  # older: 0.10 > 0.9 by number
        "v41jax_old_pkg-1.0-cp27-cp27mu-win32.whl",
        "notes.txt",
    ):
        (tmp_path / name).write_text("")
    got = dc.select_wheels(str(tmp_path))
    assert [os.path.basename(p) for p in got["install"]] == [
        "v41jax_absent_pkg-0.10-py3-none-any.whl"
    ]
    assert len(got["present"]) == 1 and got["present"][0].startswith("pytest-9.2.0")
    assert got["incompatible"] == ["v41jax_old_pkg-1.0-cp27-cp27mu-win32.whl"]
    forced = dc.select_wheels(str(tmp_path), force_all=True)
    assert len(forced["install"]) == 2 and not forced["present"]
    assert dc.select_wheels(str(tmp_path / "missing")) == {
        "install": [],
        "present": [],
        "incompatible": [],
    }


def test_run_command_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen(['sleep', '120']); open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True); time.sleep(120)\n"
    )
    log = str(tmp_path / "log")
    r = device_env.run_command([sys.executable, "-c", code], 3, dict(os.environ), log)
    assert r["status"] == "timeout" and "started" in r["output_tail"]
    child = int(pid_file.read_text())
    for _ in range(50):  # the orphaned grandchild is reaped by init shortly after the kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's grandchild {child} outlived its timeout")
    r = device_env.run_command(["/nonexistent/tool"], 5, dict(os.environ), log)
    assert r["status"] == "failed" and "could not start" in r["output_tail"]


# A stand-in benchmark: its --help lists --quick and --json; a run writes its JSON there.
FAKE_BENCH = textwrap.dedent(
    """
    import json, sys
    if "--help" in sys.argv:
        print("--quick  --json JSON")
    else:
        assert "--quick" in sys.argv, sys.argv
        json.dump({"rows": [{"us": 1.5}]}, open(sys.argv[sys.argv.index("--json") + 1], "w"))
    """
)


def _stages(tmp_path):
    py = sys.executable
    train_out = 'print("log line"); print("{\\n  \\"step\\": 20\\n}")'
    return [
        dc.Stage("train", [py, "-c", train_out], 60, required=True),
        dc.Stage(
            "bench_fake", [py, "-c", FAKE_BENCH, "fake"], 60, json_path=str(tmp_path / "f.json")
        ),
        dc.Stage("bench_broken", [py, "-c", "import sys; sys.exit(3)", "x"], 60, json_path="b"),
    ]


def test_run_check_writes_one_report_with_every_stage(tmp_path):
    out = str(tmp_path / "report.json")
    rc = dc.run_check(_stages(tmp_path), {"device": "x"}, out, dict(os.environ), str(tmp_path), 300)
    assert rc == 0  # only a benchmark failed: recorded, not fatal
    with open(out) as f:
        report = json.load(f)
    by_name = {s["name"]: s for s in report["stages"]}
    assert list(by_name) == ["train", "bench_fake", "bench_broken"]
    assert by_name["train"]["status"] == "passed" and by_name["train"]["result"] == {"step": 20}
    assert by_name["bench_fake"]["json"] == {"rows": [{"us": 1.5}]}
    assert by_name["bench_fake"]["command"][-3:] == ["--quick", "--json", str(tmp_path / "f.json")]
    assert (
        by_name["bench_broken"]["status"] == "failed"
        and "--help failed" in by_name["bench_broken"]["note"]
    )
    assert report["summary"] == {
        "failed_or_skipped": ["bench_broken"],
        "passed": ["train", "bench_fake"],
    }
    assert all("duration_s" in s and "output_tail" in s for s in report["stages"])


def test_run_check_skips_stages_past_the_budget_and_fails_on_a_required_one(tmp_path):
    out = str(tmp_path / "report.json")
    rc = dc.run_check(_stages(tmp_path)[:1], {}, out, dict(os.environ), str(tmp_path), 5)
    assert rc == 1
    with open(out) as f:
        (stage,) = json.load(f)["stages"]
    assert stage["status"] == "skipped" and "budget ran out (5 s were left" in stage["note"]


def _wheel(folder, dist: str, version: str, source: str) -> str:
    """A minimal pure-Python wheel (module, METADATA, WHEEL, RECORD), as pip builds them."""
    import zipfile

    path = os.path.join(folder, f"{dist}-{version}-py3-none-any.whl")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_install_wheels_offline_into_a_target_folder(tmp_path):
    wheel = _wheel(str(tmp_path), "v41jax_wheel_probe", "0.1", "VALUE = 7\n")
    site = str(tmp_path / "site")
    env = dict(os.environ, PIP_NO_INDEX="1")
    r = device_env.install_wheels([wheel], site, env, str(tmp_path / "pip.log"))
    assert r["status"] == "passed", r.get("output_tail")
    assert r["installed"] == [os.path.basename(wheel)] and r["site"] == site
    code = "import v41jax_wheel_probe as m; print(m.VALUE)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(env, PYTHONPATH=site), capture_output=True, text=True
    )
    assert out.stdout.strip() == "7", out.stderr


def test_versions_line_names_a_version_other_than_the_pin():
    pins = device_env.pinned_versions()
    assert pins["jax"] and pins["flax"]  # read from requirements.txt
    line = device_env.versions_line({"jax": "0.11.2", "flax": pins["flax"]}, pins)
    assert f"jax 0.11.2 (requirements.txt: {pins['jax']})" in line
    assert f"flax {pins['flax']}," in line and "optax MISSING" in line
