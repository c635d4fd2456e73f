"""`python -m v41jax bench --help` lists every benchmark with what it measures."""

import subprocess
import sys

import pytest

from v41jax.bench.__main__ import BENCHMARKS, main


def test_bench_help_lists_every_benchmark(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, what) in BENCHMARKS.items():
        assert f"  {name}" in out and what in out


def test_an_unknown_benchmark_is_named_and_the_list_printed(capsys):
    assert main(["nope"]) == 2
    captured = capsys.readouterr()
    assert "unknown benchmark 'nope'" in captured.err and "host_decode" in captured.out


@pytest.mark.e2e
def test_the_cli_hands_bench_help_to_the_benchmarks():
    out = subprocess.run(
        [sys.executable, "-m", "v41jax", "bench", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in BENCHMARKS)
