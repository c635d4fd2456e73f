"""Analysis of DSpark round logs (v41jax/dspark/analysis/round_logs.py) on synthetic logs with
known answers.

Rounds are simulated from known conditional acceptance rates p[r, b, j]: draft j is accepted
with probability p_j given drafts < j were, and A = the accepted prefix within L drafts. So
alpha_j = p_j is recovered by acceptance_per_position, E[A + 1] = 1 + sum_j prod_{i<=j} p_i
by tokens_per_round, and confidence = p is calibrated (ECE ~ 0) while p + 0.2 is not.
"""

import json

import numpy as np
import pytest

from v41jax.dspark.analysis.round_logs import (
    acceptance_per_position,
    calibration,
    markdown_table,
    merge_logs,
    modelled_seconds,
    plot_acceptance,
    plot_reliability,
    plot_throughput,
    predicted_tokens_per_round,
    tokens_per_round,
)

ALPHA = (0.8, 0.6, 0.5)


def _simulate(rates, verify_len, seed=0):
    """accepted int [R, B]: the accepted prefix of Bernoulli(rates [R, B, K]) within L drafts."""
    rng = np.random.default_rng(seed)
    ok = rng.random(rates.shape) < rates
    ok &= np.arange(1, rates.shape[-1] + 1) <= verify_len[..., None]
    return np.cumprod(ok, axis=-1).sum(-1)


def _log(r=100, b=1000, seed=0):
    rates = np.broadcast_to(np.array(ALPHA), (r, b, len(ALPHA)))
    length = np.full((r, b), len(ALPHA))
    active = np.ones((r, b), bool)
    return rates, length, _simulate(rates, length, seed), active


def test_recovers_acceptance_and_tokens_per_round():
    _, length, acc, active = _log()
    alpha, reached = acceptance_per_position(length, acc, active, 3)
    np.testing.assert_allclose(alpha, ALPHA, atol=0.01)
    # reached_1 = every round; reached_j = rounds with A >= j - 1
    assert reached[0] == acc.size and reached[1] == (acc >= 1).sum()
    expected = 1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5
    assert predicted_tokens_per_round(ALPHA) == pytest.approx(expected)
    assert predicted_tokens_per_round(ALPHA, 2) == pytest.approx(1 + 0.8 + 0.48)
    assert tokens_per_round(acc, active) == pytest.approx(
        predicted_tokens_per_round(alpha), abs=0.02
    )
    assert tokens_per_round(acc, active) == pytest.approx(expected, abs=0.02)


def test_calibrated_vs_shifted_confidence():
    rates, length, acc, active = _log(r=40)
    good = calibration(rates, length, acc, active)
    bad = calibration(np.clip(rates + 0.2, 0, 1), length, acc, active)
    json.dumps(good), json.dumps(bad)  # plain JSON-able
    assert good["ece"] < 0.02 and max(good["ece_per_position"]) < 0.02
    assert bad["ece"] > 0.15
    assert (
        good["n"]
        == sum(good["reached_per_position"])
        == sum(b["count"] for b in good["reliability"])
    )
    g, s = good["length"], bad["length"]
    assert g["mean_predicted"] == pytest.approx(1.52)  # 0.8 + 0.48 + 0.24
    assert g["mean_realised"] == pytest.approx(1.52, abs=0.03)
    assert g["ece_tokens"] < 0.03 and g["ece_fraction"] == pytest.approx(g["ece_tokens"] / 3)
    assert s["mean_predicted"] == pytest.approx(1.0 + 0.8 + 0.56)  # (1.0, 0.8, 0.7) survivals
    assert s["ece_tokens"] > 0.7


def test_calibration_with_varying_confidence():
    """Confidences drawn per draft: several bins filled, still calibrated; shifted is not."""
    rng = np.random.default_rng(1)
    c = rng.uniform(0.05, 0.75, (40, 500, 4))
    length = rng.integers(1, 5, (40, 500))
    active = rng.random((40, 500)) < 0.9
    acc = np.where(active, _simulate(c, length, seed=2), 0)
    good = calibration(c, np.where(active, length, 0), acc, active)
    assert sum(b["count"] > 0 for b in good["reliability"]) == 8
    assert good["ece"] < 0.02 and good["length"]["ece_tokens"] < 0.05
    assert calibration(c + 0.2, length, acc, active)["ece"] == pytest.approx(0.2, abs=0.02)


def test_hand_built_log():
    # round 0: row 0 L=3 A=1 (reached 1,2; accepted 1), row 1 L=2 A=2 (reached/accepted 1,2)
    # round 1: row 0 L=3 A=0 (reached 1), row 1 inactive (garbage values are ignored)
    length = np.array([[3, 2], [3, 3]])
    acc = np.array([[1, 2], [0, 3]])
    active = np.array([[True, True], [True, False]])
    alpha, reached = acceptance_per_position(length, acc, active, 3)
    assert reached.tolist() == [3, 2, 0]
    np.testing.assert_allclose(alpha, [2 / 3, 1 / 2, np.nan])
    assert tokens_per_round(acc, active) == pytest.approx((2 + 3 + 1) / 3)
    with pytest.raises(ValueError, match="NaN"):
        predicted_tokens_per_round(alpha)
    assert predicted_tokens_per_round(alpha, 2) == pytest.approx(1 + 2 / 3 + 1 / 3)
    conf = np.array([[[0.9, 0.5, 0.1], [0.9, 0.7, 0.3]], [[0.25, 0.5, 0.5], [1.0, 1.0, 1.0]]])
    cal = calibration(conf, length, acc, active, bins=2)
    # reached predictions: 0.9 (1), 0.5 (0), 0.9 (1), 0.7 (1), 0.25 (0)
    lo, hi = cal["reliability"]
    assert (lo["count"], lo["confidence"], lo["acceptance"]) == (1, 0.25, 0.0)
    assert hi["count"] == 4 and hi["confidence"] == pytest.approx(0.75)
    assert hi["acceptance"] == pytest.approx(0.75)
    assert cal["ece"] == pytest.approx(0.25 / 5)
    assert cal["ece_per_position"][2] is None  # position 3 never reached
    pred = [0.9 + 0.45 + 0.045, 0.9 + 0.63, 0.25 + 0.125 + 0.0625]
    assert cal["length"]["mean_predicted"] == pytest.approx(np.mean(pred))
    assert cal["length"]["mean_realised"] == pytest.approx(1.0)
    assert cal["length"]["n_rounds"] == 3


def test_positions_beyond_verify_len_are_never_reached():
    rng = np.random.default_rng(3)
    length = rng.integers(1, 6, (20, 50))
    ones = np.ones((20, 50, 5))
    acc = _simulate(ones, length)  # every verified draft accepted: A = L
    np.testing.assert_array_equal(acc, length)
    alpha, reached = acceptance_per_position(length, acc, np.ones_like(acc, bool), 5)
    np.testing.assert_array_equal(reached, [(length >= j).sum() for j in range(1, 6)])
    np.testing.assert_array_equal(alpha, np.ones(5))


def test_merge_logs_pads_with_inactive_rounds():
    a = {"confidence": np.full((2, 1, 3), 0.5), "verify_len": [[3], [3]], "accepted": [[1], [2]]}
    a["active"] = np.ones((2, 1), bool)
    b = {
        "confidence": np.full((3, 2, 3), 0.7),
        "verify_len": np.full((3, 2), 2),
        "accepted": np.ones((3, 2), int),
        "active": np.ones((3, 2), bool),
        "tokens": np.zeros((2, 9)),  # extra DSparkOutput fields are dropped
    }
    m = merge_logs([a, b])
    assert set(m) == {"confidence", "verify_len", "accepted", "active"}
    assert m["confidence"].shape == (3, 3, 3) and m["active"].shape == (3, 3)
    assert m["active"][:, 0].tolist() == [True, True, False]
    assert (m["verify_len"][2, 0], m["accepted"][2, 0]) == (0, 0)
    assert tokens_per_round(m["accepted"], m["active"]) == pytest.approx((2 + 3 + 6 * 2) / 8)
    with pytest.raises(ValueError, match="block sizes"):
        merge_logs([a, b | {"confidence": np.full((3, 2, 4), 0.7)}])
    with pytest.raises(ValueError, match="lacks keys"):
        merge_logs([{"accepted": a["accepted"]}])


def test_plots_and_table(tmp_path):
    _, length, acc, active = _log(r=5, b=20)
    rates = np.broadcast_to(np.array(ALPHA), (5, 20, 3))
    flat = np.full_like(rates, 0.5)
    cal = {n: calibration(c, length, acc, active) for n, c in (("ok", rates), ("flat", flat))}
    alpha = {"a": [0.8, 0.6, 0.5], "b": [0.9, None, np.nan]}
    rows = [
        {"name": n, "batch": b, "tokens_per_s": t * b}
        for n, t in (("plain", 10.0), ("dspark", 25.0))
        for b in (1, 4, 16, 64)
    ]
    paths = [
        plot_reliability(cal, str(tmp_path / "rel.png")),
        plot_acceptance(alpha, str(tmp_path / "acc.png")),
        plot_throughput(rows, str(tmp_path / "thr.png")),
    ]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = markdown_table(
        [{"name": "x", "ece": 0.01234}, {"name": "y", "ece": None}],
        [("name", "drafter", ""), ("ece", "ECE", ".3f")],
    )
    assert table.splitlines() == [
        "| drafter | ECE |",
        "| --- | --- |",
        "| x | 0.012 |",
        "| y | - |",
    ]


def test_bad_input():
    length, acc, active = np.full((2, 2), 3), np.ones((2, 2), int), np.ones((2, 2), bool)
    conf = np.full((2, 2, 3), 0.5)
    with pytest.raises(ValueError, match="accepted=4"):
        acceptance_per_position(length, acc + 3, active, 3)
    with pytest.raises(ValueError, match="verify_len=3"):
        acceptance_per_position(length, acc, active, 2)
    with pytest.raises(ValueError, match="shape"):
        acceptance_per_position(length, acc[:1], active, 3)
    with pytest.raises(ValueError, match="shape"):
        tokens_per_round(acc, active[:1])
    with pytest.raises(ValueError, match="k=0"):
        acceptance_per_position(length, acc, active, 0)
    with pytest.raises(ValueError, match=r"does not match"):
        calibration(conf[:, :1], length, acc, active)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        calibration(conf + 0.6, length, acc, active)
    with pytest.raises(ValueError, match="bins=0"):
        calibration(conf, length, acc, active, bins=0)
    with pytest.raises(ValueError, match="integers"):
        acceptance_per_position(length + 0.5, acc, active, 3)
    with pytest.raises(ValueError, match="needs name"):
        plot_throughput([{"name": "x", "batch": 0, "tokens_per_s": 1.0}], "unused.png")


def test_modelled_seconds_by_hand():
    """3 rounds of 2 rows: widths 3 (max over active rows; the inactive row's 5 is ignored),
    1, then no active row (not counted); cost = 1 + tokens / 10."""
    length = np.array([[3, 5], [1, 0], [0, 0]])
    active = np.array([[True, False], [True, False], [False, False]])
    got = modelled_seconds(length, active, lambda t: 1.0 + t / 10)
    assert got == pytest.approx((1 + 2 * 4 / 10) + (1 + 2 * 2 / 10))
    with pytest.raises(ValueError, match=r"must both be \[R, B\]"):
        modelled_seconds(length, active[:, :1], lambda t: 1.0)
