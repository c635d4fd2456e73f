"""The decode benchmark runs end to end at toy sizes through `python -m v41jax.bench decode`'s
entry point and writes one JSON row per batch and variant, ratios against the bare loop."""

import json

import pytest

from v41jax.bench.__main__ import main
from v41jax.bench.decode_bench import VARIANTS


@pytest.mark.slow  # four compiled decoders per batch; the sampling plans are tested fast
def test_decode_bench_rows(tmp_path):
    path = tmp_path / "decode.json"
    argv = ["decode", "--layers", "1", "--d-model", "32", "--vocab", "67", "--batches", "1,3"]
    argv += ["--new-tokens", "3", "--prompt", "2", "--max-seq-len", "8", "--passes", "2"]
    assert main([*argv, "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["benchmark"] == "decode" and "platform" in out["machine"]
    assert [(r["batch"], r["variant"]) for r in out["rows"]] == [
        (b, v) for b in (1, 3) for v in VARIANTS
    ]
    for r in out["rows"]:
        assert {"batch", "variant", "ms_per_token_fastest", "ms_per_token_median"} <= set(r)
        assert 0 < r["ms_per_token_fastest"] <= r["ms_per_token_median"]
        assert r["ratio_vs_bare"] > 0
        assert r["same_greedy_tokens"]  # same argmax over the same cache: the same tokens
        if r["variant"].startswith("bare"):
            assert r["ratio_vs_bare"] == 1.0
