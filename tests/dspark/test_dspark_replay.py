"""Replay of logged rounds (v41jax.dspark.train.replay): the premise (verifying w of the same
round's drafts accepts min(A, w)), the oracle bound against brute force, the fixed and
scheduled rows against direct sums, and named errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.dspark.decode.scheduler import CostTable, schedule_verify_lengths
from v41jax.dspark.train.replay import oracle_widths, replay_policies, stack_rounds
from v41jax.speculative import speculative_sample


def random_log(r=6, b=4, k=3, seed=0):
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.05, 1.0, (r, b, k))
    acc = rng.integers(0, k + 1, (r, b))
    active = rng.uniform(size=(r, b)) < 0.8
    active[0] = True
    return conf, np.full((r, b), k), acc, active


def test_verifying_a_prefix_accepts_min_of_the_full_count():
    """The replay's premise, on the real sampler: the same key and drafts verified with
    length w accept min(A_K, w) (odd sizes, near-uniform laws so rejections happen)."""
    b, k, v = 7, 5, 11
    for seed in range(20):
        keys = jax.random.split(jax.random.key(seed), 4)
        q = jax.nn.softmax(jax.random.normal(keys[0], (b, k, v)), -1)
        p = jax.nn.softmax(jax.random.normal(keys[1], (b, k + 1, v)), -1)
        d = jax.random.categorical(keys[2], jnp.log(q)).astype(jnp.int32)
        _, full = speculative_sample(keys[3], d, q, p, jnp.full((b,), k, jnp.int32))
        for w in range(k):
            _, acc = speculative_sample(keys[3], d, q, p, jnp.full((b,), w, jnp.int32))
            np.testing.assert_array_equal(np.asarray(acc), np.minimum(np.asarray(full), w))


def test_oracle_matches_brute_force_over_every_width_sequence():
    rng = np.random.default_rng(3)
    for _ in range(30):
        r, k = rng.integers(1, 5), rng.integers(1, 4)
        t = rng.uniform(1, 10, (r, k))
        s = rng.uniform(0.5, 3, (r, k))
        best = max(
            sum(t[i, w] for i, w in enumerate(ws)) / sum(s[i, w] for i, w in enumerate(ws))
            for ws in itertools.product(range(k), repeat=r)
        )
        widths, ratio = oracle_widths(t, s)
        assert ratio == pytest.approx(best, rel=1e-12)
        rows = np.arange(r)
        assert t[rows, widths - 1].sum() / s[rows, widths - 1].sum() == pytest.approx(best)


@pytest.mark.parametrize("basis", ["width", "padded"])
def test_fixed_and_scheduled_rows_are_the_direct_sums(basis):
    conf, length, acc, active = random_log()
    b, k = active.shape[1], conf.shape[2]
    cost = CostTable(tuple(b * (1 + w) for w in range(1, k + 1)), (1.0, 1.3, 2.2))
    out = replay_policies(conf, length, acc, active, cost, bases=(basis,))
    live = active.any(1)
    for w in range(1, k + 1):
        toks = (active * (1 + np.minimum(acc, w))).sum()
        secs = live.sum() * cost(b * (1 + w))
        assert out["fixed"][w - 1] == pytest.approx(toks / secs)
    widths = [
        int(
            np.max(
                np.where(a, schedule_verify_lengths(c, cost, basis=basis, active_B=a).verify_len, 1)
            )
        )  # fmt: skip
        for c, a in zip(conf[live], active[live], strict=True)
    ]
    rounds = zip(active[live], acc[live], widths, strict=True)
    toks = sum((a * (1 + np.minimum(x, w))).sum() for a, x, w in rounds)
    secs = sum(cost(b * (1 + w)) for w in widths)
    assert out["scheduled"][basis] == pytest.approx(toks / secs)
    assert out["scheduled_widths"][basis] == pytest.approx(np.mean(widths))
    assert out["oracle"] >= max(out["fixed"]) - 1e-12
    assert out["oracle"] >= out["scheduled"][basis] - 1e-12
    assert out["rounds"] == live.sum()


def test_flat_and_steep_tables_drive_the_scheduler_to_the_ends():
    conf, length, acc, active = random_log(seed=1)
    b, k = active.shape[1], conf.shape[2]
    tokens = tuple(b * (1 + w) for w in range(1, k + 1))
    both = ("width", "padded")
    flat = replay_policies(conf, length, acc, active, CostTable(tokens, (1.0,) * k), both)
    steep = replay_policies(conf, length, acc, active, CostTable(tokens, (1.0, 50.0, 100.0)), both)
    for basis in both:
        assert flat["scheduled_widths"][basis] == k
        assert flat["scheduled"][basis] == pytest.approx(flat["fixed"][-1])
        assert steep["scheduled_widths"][basis] == 1
        assert steep["scheduled"][basis] == pytest.approx(steep["fixed"][0])


def test_stack_rounds_and_bad_input_is_named():
    conf, length, acc, active = random_log()
    log = dict(confidence=conf, verify_len=length, accepted=acc, active=active)
    stacked = stack_rounds([log, log])
    assert stacked["confidence"].shape == (12, 4, 3)
    b, k = active.shape[1], conf.shape[2]
    cost = CostTable(tuple(b * (1 + w) for w in range(1, k + 1)), (1.0, 1.3, 2.2))
    with pytest.raises(ValueError, match="different batch sizes"):
        stack_rounds([log, {key: v[:, :2] for key, v in log.items()}])
    with pytest.raises(ValueError, match="all K=3 drafts"):
        replay_policies(conf, np.where(active, 2, 3), np.minimum(acc, 2), active, cost)
    with pytest.raises(ValueError, match="cost table covers"):
        replay_policies(conf, length, acc, active, CostTable((4, 6, 8), (1.0, 1.3, 2.2)))
    with pytest.raises(ValueError, match="no active row"):
        replay_policies(conf, length, acc, np.zeros_like(active), cost)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        oracle_widths(np.ones((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="'total'"):
        replay_policies(conf, length, acc, active, cost, bases=("total",))
    with pytest.raises(ValueError, match="CostTable"):
        replay_policies(conf, length, acc, active, {"tokens": (8,)})


@pytest.mark.parametrize("admission", ["global", "early_stop"])
def test_width_zero_replays_as_a_plain_decode_step(admission):
    """A B-token entry in the table: width 0 emits one token per active row at cost(B) ("plain",
    a candidate of the scheduler and the oracle); a cheap plain step drives every round to 0,
    a dear one never; without the entry "plain" is None and widths start at 1."""
    conf, length, acc, active = random_log(seed=2)
    b, k = active.shape[1], conf.shape[2]
    live = active.any(1)
    for secs0, expect in ((0.2, 0.0), (5.0, None)):
        cost = CostTable(tuple(b * (1 + w) for w in range(k + 1)), (secs0, 1.0, 1.3, 2.2))
        out = replay_policies(conf, length, acc, active, cost, admission=admission)
        plain = active.sum() / (live.sum() * secs0)
        assert out["plain"] == pytest.approx(plain)
        assert out["oracle"] >= max(out["fixed"] + [plain]) - 1e-12
        if expect is not None:
            assert out["scheduled_widths"]["width"] == expect
            assert out["scheduled"]["width"] == pytest.approx(plain)
        else:
            assert out["scheduled_widths"]["width"] >= 1
    cost = CostTable(tuple(b * (1 + w) for w in range(1, k + 1)), (1.0, 1.3, 2.2))
    assert replay_policies(conf, length, acc, active, cost, admission=admission)["plain"] is None
    widths, _ = oracle_widths(np.array([[5.0, 1.0]]), np.ones((1, 2)), first=0)
    assert widths.tolist() == [0]
