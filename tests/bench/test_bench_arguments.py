"""Benchmark arguments: the Engram bench at any positive --tokens; non-positive sizes rejected
by the bench argument parsers with an error naming the value."""

import pytest

from v41jax.bench.__main__ import main as bench_main
from v41jax.bench.engram_bench import token_shape


@pytest.mark.parametrize(
    "tokens, shape",
    [(1, (1, 1)), (256, (1, 256)), (512, (1, 512)), (1000, (1, 1000)), (2048, (4, 512))],
)
def test_engram_bench_token_shape_holds_exactly_the_tokens(tokens, shape):
    assert token_shape(tokens) == shape


def test_engram_bench_token_shape_rejects_non_positive():
    with pytest.raises(ValueError, match="--tokens must be >= 1, got 0"):
        token_shape(0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["engram", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
        (["engram", "--tokens", "-256"], "argument --tokens: must be >= 1, got -256"),
        (["engram", "--tokens", "2k"], "argument --tokens: expected a positive integer, got '2k'"),
        (["engram", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["mhc", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    ],
)
def test_bench_rejects_non_positive_sizes(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_engram_bench_runs_below_512_tokens(capsys):
    """`--tokens 256` divided by zero (256 // 512 rows); one small table, one timed call."""
    assert bench_main(["engram", "--tokens", "256", "--sizes", "1e6", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "engram" in out and "dense_ffn" in out and "jnp.take" in out
