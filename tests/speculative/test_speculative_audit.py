"""The verifier audit (v41jax/speculative/audit.py): exact verifiers pass, broken ones are flagged.

Every verifier here is `_rule` (the Leviathan et al. rule, as in
v41jax/kernels/spec_verify/reference.py: accept d_j iff u_j q_j(d_j) < p_j(d_j); at the first
rejection A < L sample max(0, p_A - q_A) by an exponential race; after L acceptances sample the
bonus from p_L) with one hook swapped for one of the bugs of Leviathan et al. 2023. Each bug changes
the law of the emitted tokens (P(token_j = v | emitted, history) != p_j(v)), the law of the
acceptance count (P(A >= j | L) != prod_{i<j} beta_i), or the output format, so the audit must
fail it, at its default 200k samples per case; the exact ones must pass (seeds are fixed, so
this is deterministic, and an exact verifier fails with probability <= alpha = 1e-3 anyway).
"""

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41jax.kernels.spec_verify.reference import race_keys
from v41jax.speculative import speculative_sample
from v41jax.speculative.audit import _g_test, audit_verifier, main, make_cases, reference_verifier

REPO = Path(__file__).resolve().parents[2]


def _take_row(x, a):
    """x[b, a[b]] for x [B, R, V], a [B]."""
    return jnp.take_along_axis(x, a[:, None, None], axis=1)[:, 0]


def _race(residual, w):
    """Exact sampler: argmin E_v / r_v picks v with probability r_v / sum(r)."""
    return jnp.argmin(race_keys(residual, w), axis=-1)


def _rule(
    key,
    d,
    q,
    p,
    vl,
    *,
    accept=lambda p_d, q_d, u: u * q_d < p_d,
    residual=lambda p_a, q_a: jnp.maximum(p_a - q_a, 0.0),
    sample=_race,
    draft_hook=None,
    q_hook=None,
    length_hook=None,
    bonus=True,
):
    """The verification rule with hooks; all defaults = exact (agrees with the reference)."""
    b, k = d.shape
    v = p.shape[-1]
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, (b, k))
    w = jax.random.uniform(k2, (b, v))
    d_in = d
    if draft_hook is not None and q is not None:
        d = draft_hook(d, q)
    if q_hook is not None and q is not None:
        q = q_hook(q)
    q_rows = jax.nn.one_hot(d, v) if q is None else q  # None: one-hot drafts
    q_rows = jnp.concatenate([q_rows, jnp.zeros((b, 1, v))], axis=1)  # row K: bonus, no draft
    p_d = jnp.take_along_axis(p[:, :k], d[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q_rows[:, :k], d[..., None], -1)[..., 0]
    if length_hook is not None:
        vl = length_hook(vl, p_d, q_d)
    ok = accept(p_d, q_d, u) & (jnp.arange(k) < vl[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_a, q_a = _take_row(p, a), _take_row(q_rows, a)
    rejected = (a < vl)[:, None]
    r = jnp.where(rejected, residual(p_a, q_a), p_a)
    r = jnp.where(jnp.any(r > 0, -1, keepdims=True), r, p_a)
    token = sample(r, w).astype(jnp.int32)
    if not bonus:
        token = jnp.where(rejected[:, 0], token, -1)
    # a draft-rewriting bug emits the drafts it verified (that is what it would append)
    emitted = d if draft_hook is not None else d_in
    pos = jnp.arange(k + 1)[None, :]
    drafts = jnp.concatenate([emitted, jnp.zeros((b, 1), jnp.int32)], 1)
    out = jnp.where(pos < a[:, None], drafts, jnp.where(pos == a[:, None], token[:, None], -1))
    return out.astype(jnp.int32), a.astype(jnp.int32)


def exact_rule(key, d, q, p, vl):
    """The hook base with no bug (a second exact verifier, independent of the reference)."""
    return _rule(key, d, q, p, vl)


def _inverse_cdf_unnormalised(r, w):
    """Inverse CDF of the raw residual with one uniform; u > sum(r) falls to the last token."""
    cdf = jnp.cumsum(r, axis=-1)
    return jnp.minimum(jnp.sum(cdf <= w[:, :1], axis=-1), r.shape[-1] - 1)


def _first_target_short(vl, p_d, q_d):
    """L' = min(L, first j with p_j(d_j) < q_j(d_j)): the length peeks at the target."""
    short = p_d < q_d
    first = jnp.where(jnp.any(short, 1), jnp.argmax(short, 1), p_d.shape[1])
    return jnp.minimum(vl, first)


def _temperature(q, t=0.7):
    """softmax(log q / t): the tempered law the verifier sees (the drafts came from q)."""
    return jax.nn.softmax(jnp.log(jnp.maximum(q, 1e-30)) / t, axis=-1)


BROKEN = {
    # The drafter emitted argmax q but the verifier is handed the softmax q: acceptance uses
    # q(d) for a d that was never drawn from q, so accepted tokens are over-weighted at argmax.
    "argmax_drafts_softmax_q": dict(draft_hook=lambda d, q: jnp.argmax(q, -1).astype(jnp.int32)),
    # Temperature 0.7 on the verifier's q only: min(p, q') + max(0, p - q') mass != p.
    "temperature_one_side": dict(q_hook=_temperature),
    # Inverse CDF on max(0, p - q) without dividing by its mass 1 - beta: u beyond the mass
    # falls to the last token, which absorbs the missing beta.
    "residual_unnormalised": dict(sample=_inverse_cdf_unnormalised),
    # Rejections resampled from p: the accepted min(p, q) part is then counted twice.
    "residual_from_p": dict(residual=lambda p_a, q_a: p_a),
    # max(0, q - p): rejections emit exactly the tokens the target under-weights.
    "residual_sign_swapped": dict(residual=lambda p_a, q_a: jnp.maximum(q_a - p_a, 0.0)),
    # All L accepted -> -1 instead of a token from p_L (malformed output and a biased law).
    "bonus_dropped": dict(bonus=False),
    # u = 0.5: accept iff p/q > 1/2, deterministic instead of with probability min(1, p/q).
    "u_fixed_half": dict(accept=lambda p_d, q_d, u: 0.5 * q_d < p_d),
    # The verify length stops before the first draft the target under-weights: target-side
    # information selects which drafts are verified (only p >= q drafts ever get accepted).
    "verify_len_from_target": dict(length_hook=_first_target_short),
    "always_accept": dict(accept=lambda p_d, q_d, u: jnp.ones_like(u, bool)),
}


def _named(name, **hooks):
    """The rule with `hooks`, named (the CLI and the report print the name)."""
    fn = functools.partial(_rule, **hooks)
    fn.__name__ = name
    return fn


residual_from_p = _named("residual_from_p", **BROKEN["residual_from_p"])  # for the CLI test


def _correct_verifiers():
    """Exact verifiers: the reference wrapper, the hook base, and the real sampler."""
    return [
        pytest.param(reference_verifier, id="reference"),
        pytest.param(exact_rule, id="exact_rule"),
        pytest.param(speculative_sample, id="speculative_sample"),
    ]


@pytest.mark.parametrize("verifier", _correct_verifiers())
def test_exact_verifiers_pass(verifier):
    report = audit_verifier(verifier)
    assert report.passed, report.format()
    assert report.p_value >= report.alpha
    assert all(t.passed for t in report.tests)
    cases = {t.case for t in report.tests}
    assert cases == {c.name for c in make_cases(6, 3, 0)}
    # every case ran the validity, position-law and acceptance-law checks
    for case in cases:
        names = [t.name for t in report.tests if t.case == case]
        assert "validity" in names and "law 0" in names and any(n.startswith("A|") for n in names)


@pytest.mark.parametrize("num_samples", [4_000, pytest.param(20_000, marks=pytest.mark.slow)])
def test_the_fused_kernel_passes(num_samples):
    """The Pallas kernel path (interpreted on CPU: slow per row, so fewer samples; the
    interpreter's time grows with them, 20k rows take ~80 s)."""
    kernel = functools.partial(speculative_sample, impl="pallas")
    report = audit_verifier(kernel, num_samples=num_samples)
    assert report.passed, report.format()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_verifiers_are_flagged(name):
    report = audit_verifier(_named(name, **BROKEN[name]))
    assert not report.passed, report.format()
    assert report.p_value < report.alpha
    print(f"{name}: min adjusted p = 1e{report.log10_p_value:.0f}, {len(report.failed)} failed")


def test_reference_wrapper_matches_the_hook_base():
    """Same key, same uniforms: `exact_rule` and the reference emit identical outputs."""
    rng = np.random.default_rng(1)
    b, k, v = 512, 3, 6
    p = jnp.asarray(rng.dirichlet(np.ones(v), (b, k + 1)), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(v), (b, k)), jnp.float32)
    d = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
    vl = jnp.asarray(rng.integers(0, k + 1, b), jnp.int32)
    key = jax.random.PRNGKey(3)
    for qq in (q, None):
        want, got = reference_verifier(key, d, qq, p, vl), exact_rule(key, d, qq, p, vl)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_g_test_basics():
    """G = 0 on exact counts; a count where E = 0 is an automatic failure (p = 0)."""
    g, dof, p, bad = _g_test(np.array([50.0, 30, 20, 0]), np.array([50.0, 30, 20, 0]))
    assert (g, dof, p, bad) == (0.0, 2, 1.0, 0)
    g, dof, p, bad = _g_test(np.array([50.0, 30, 19, 1]), np.array([50.0, 30, 20, 0]))
    assert p == 0.0 and bad == 1


def test_report_format_and_small_vocab_and_k():
    report = audit_verifier(reference_verifier, vocab_size=4, k=2, num_samples=20_000, seed=5)
    assert report.passed
    text = report.format("all")
    assert "PASSED" in text and "validity" in text and "A|L=2" in text and "observed" in text
    # deterministic: same seed, same statistics
    again = audit_verifier(reference_verifier, vocab_size=4, k=2, num_samples=20_000, seed=5)
    assert [t.statistic for t in again.tests] == [t.statistic for t in report.tests]


@pytest.mark.e2e
def test_cli_passes_the_reference():
    proc = subprocess.run(
        [sys.executable, "-m", "v41jax.speculative.audit",
         "v41jax.speculative.audit:reference_verifier",
         "--samples", "20000"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: PASSED" in proc.stdout


def test_cli_flags_a_broken_verifier(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # importlib mode: `tests.speculative...` needs the root
    rc = main(["tests.speculative.test_speculative_audit:residual_from_p", "--samples", "20000"])
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: FAILED" in out and "NO" in out
    rc = main([f"{Path(__file__)}:exact_rule", "--samples", "20000", "--detail", "failed"])
    assert rc == 0 and "verdict: PASSED" in capsys.readouterr().out


def test_cli_prints_a_short_summary_and_verbose_lists_every_check(capsys):
    small = ["v41jax.speculative.audit:reference_verifier", "--samples", "5000", "--vocab", "4"]
    assert main(small) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) <= 12 and lines[-1].startswith("verdict: PASSED")
    assert "--verbose" in lines[-1]
    table = "\n".join(lines[3:-1])
    for case in make_cases(4, 3, 0):  # one line per case: its worst check and p-values
        assert case.name in table
    assert "worst check" in lines[3] and "p_adj" in lines[3]
    assert main([*small, "--verbose"]) == 0
    verbose = capsys.readouterr().out.strip().splitlines()
    assert len(verbose) > 50 and "observed / expected" in "\n".join(verbose)
    assert verbose[-1].startswith("verdict: PASSED")


def test_summary_names_the_failed_checks():
    report = audit_verifier(
        _named("residual_from_p", **BROKEN["residual_from_p"]), num_samples=20_000
    )
    text = report.summary()
    assert len(text.splitlines()) <= 14 and "verdict: FAILED" in text and "  NO" in text
    assert "failed: " in text and f"{len(report.failed)} of {len(report.tests)}" in text


def test_cli_help_is_complete(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "does a speculative verifier preserve the target distribution?" in out
    assert "Exit status: 0 if the audit passes, 1 if\nit fails, 2 on a usage error." in out
    assert "--verbose" in out and "module:function or path/to/file.py:function" in out


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "v41jax.speculative.audit.reference_verifier",
            "verifier 'v41jax.speculative.audit.reference_verifier': expected module:function or "
            "path/to/file.py:function (did you mean v41jax.speculative.audit:reference_verifier?)",
        ),
        ("reference_verifier", "verifier 'reference_verifier': expected module:function"),
        ("verify.py", "verifier 'verify.py': expected module:function"),
        (
            "v41jax.speculative.nope:f",
            "verifier 'v41jax.speculative.nope:f': no module named 'v41jax.speculative.nope'",
        ),
        ("nope_pkg.mod:f", "verifier 'nope_pkg.mod:f': no module named 'nope_pkg'"),
        ("no/such/file.py:f", "verifier 'no/such/file.py:f': no file 'no/such/file.py'"),
        (
            "v41jax.speculative.audit:reference_verifer",
            "'v41jax.speculative.audit' has no attribute 'reference_verifer' (did you mean "
            "v41jax.speculative.audit:reference_verifier?)",
        ),
        ("v41jax.speculative.audit:MIN_EXPECTED", "'MIN_EXPECTED' is a float, not a function"),
    ],
)
def test_cli_bad_verifier_spec_is_a_usage_error(spec, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: verifier {spec!r}: " in err and message in err and "Traceback" not in err


def test_cli_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["v41jax.speculative.audit:reference_verifier", "--samples", "0"])
    assert e.value.code == 2 and "need --samples >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_samples=0"):
        audit_verifier(reference_verifier, num_samples=0)
