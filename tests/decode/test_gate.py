"""`SpeculationGate`: the measured throughput of drafted and plain segments decides whether
drafting stays on; the losing mode is probed again, less often while it keeps losing."""

import math

import pytest

from v41jax.decode.gate import SpeculationGate


def test_the_rate_is_the_decayed_ratio_of_tokens_to_seconds():
    g = SpeculationGate(decay=0.5)
    assert math.isnan(g.rate("plain"))
    g.record("plain", 100, 1.0, 1)
    g.record("plain", 300, 2.0, 1)
    assert g.rate("plain") == pytest.approx((0.5 * 100 + 300) / (0.5 * 1.0 + 2.0))


def test_drafting_goes_on_until_both_modes_are_measured_then_the_faster_wins():
    g = SpeculationGate(probe_rounds=4)
    assert g.speculate() and not g.probe_plain()  # nothing measured: the policy decides
    g.record("drafted", 300, 1.0, 2)
    assert g.speculate() and g.probe_plain()  # plain never measured: probe it
    g.record("plain", 500, 1.0, 1)
    assert not g.speculate()  # plain 500/s beats drafted 300/s
    g2 = SpeculationGate(probe_rounds=4)
    g2.record("drafted", 900, 1.0, 2)
    g2.record("plain", 500, 1.0, 1)
    assert g2.speculate() and not g2.probe_plain()


def test_a_losing_drafted_mode_is_probed_less_often_and_a_winning_one_resets_it():
    g = SpeculationGate(decay=1.0, probe_rounds=4, max_probe_rounds=8)
    g.record("drafted", 300, 1.0, 1)
    g.record("plain", 500, 1.0, 3)
    assert not g.speculate()
    g.record("plain", 500, 1.0, 1)  # 4 plain rounds since drafted: a probe is due
    assert g.speculate()
    g.record("drafted", 300, 1.0, 1)  # the probe loses: the interval doubles to 8
    assert g.summary()["probe_rounds"] == 8
    g.record("plain", 500, 1.0, 4)
    assert not g.speculate()  # 4 < 8 rounds
    g.record("plain", 500, 1.0, 4)
    assert g.speculate()
    g.record("drafted", 300, 1.0, 1)
    assert g.summary()["probe_rounds"] == 8  # capped at max_probe_rounds
    g.record("plain", 10, 1.0, 8)  # plain got slow (a load change)
    g.record("drafted", 3000, 1.0, 1)  # the probe wins: back to probe_rounds
    assert g.summary()["probe_rounds"] == 4 and g.speculate()


def test_a_winning_drafted_mode_still_probes_plain_every_probe_rounds():
    g = SpeculationGate(probe_rounds=3)
    g.record("plain", 100, 1.0, 1)
    g.record("drafted", 900, 1.0, 2)
    assert g.speculate() and not g.probe_plain()
    g.record("drafted", 900, 1.0, 1)  # 3 drafted rounds since plain
    assert g.probe_plain()
    g.record("plain", 100, 1.0, 1)
    assert not g.probe_plain()


@pytest.mark.parametrize(
    "kw, bad",
    [({"decay": 0.0}, "decay=0.0"), ({"decay": 1.5}, "decay=1.5"),
     ({"probe_rounds": 0}, "probe_rounds=0"), ({"probe_rounds": True}, "probe_rounds=True"),
     ({"probe_rounds": 8, "max_probe_rounds": 4}, "max_probe_rounds=4")],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_value(kw, bad):
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        SpeculationGate(**kw)


def test_bad_segments_are_refused_naming_the_values():
    g = SpeculationGate()
    with pytest.raises(ValueError, match="mode='fast'"):
        g.record("fast", 1, 1.0, 1)
    with pytest.raises(ValueError, match="0.0"):
        g.record("plain", 1, 0.0, 1)
    with pytest.raises(ValueError, match="rounds >= 1"):
        g.record("plain", 1, 1.0, 0)
