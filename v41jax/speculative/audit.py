"""Statistical audit: does a speculative verifier preserve the target distribution?

What the audit checks and why: docs/speculative.md.

A verifier (Leviathan et al. 2023) takes drafts d_j ~ q_j, j < K, the draft laws q (or None: one-hot
drafts), target laws p_0 .. p_K and a verify length L <= K, and emits
(d_0 .. d_{A-1}, t, -1 ..): the A accepted drafts, then one token t. With fixed tables p, q
(independent of the prefix, so the "target" is: token j ~ p_j independently), an exact verifier
satisfies, for every emitted position j <= A and every history h of earlier emitted tokens,

    P(token_j = v | position j emitted, h, L) = p_j(v)                                   (1)

(accepted d_j has law min(p_j, q_j); the residual max(0, p_j - q_j)/(1 - beta_j) is reached
with probability 1 - beta_j; together p_j. The bonus at j = L is drawn from p_L.) And

    P(A >= j | L) = prod_{i<j} beta_i  (j <= L),   beta_i = sum_v min(p_i(v), q_i(v))      (2)

(beta_i = sum_v g_i(v) p_i(v) for one-hot drafts drawn from a law g_i the verifier never sees).

Checks, per case (fixed tables; independent drafts, lengths and keys per row):
  validity  A in [0, L], out[:, :A] = drafts, out[:, A] in [0, V), out[:, A+1:] = -1 (any
            violation fails: p = 0);
  law j     G-test of emitted tokens at position j against (1), pooled;
  law j|L,h the same, stratified by (L, previous emitted token); strata with an expected count
            under 5 are merged, and a merged remainder still under 5 is skipped;
  A|L       multinomial G-test of A against (2), per verify length L >= 1.
A count in a cell of probability 0 (p_j(v) = 0, an out-of-range token, A > L) gives p = 0.
G = 2 sum O ln(O / E) is chi-square with (cells - 1) dof per stratum under the null. The
decision is Bonferroni over all m checks: a check passes if min(1, m p) >= alpha.

CLI: python -m v41jax.speculative.audit module:function [--samples N --seed S --vocab V --k K]
[--verbose] (module may also be a path/to/file.py): a summary, one line per case (--verbose:
every check and observed/expected tables); exit 0 if the audit passes, 1 if not, 2 on a usage
error (e.g. a verifier spec that does not name a function).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats
from scipy.special import xlogy

from v41jax.kernels.spec_verify import spec_verify_reference

Verifier = Callable[..., tuple[jax.Array, jax.Array]]
MIN_EXPECTED = 5.0  # the usual floor for the chi-square approximation of G


def reference_verifier(key, draft_tokens, draft_probs, target_probs, verify_len):
    """The reference rule on uniforms drawn from `key` (the audit's known-good verifier)."""
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, draft_tokens.shape)  # accept_u: one per draft
    w = jax.random.uniform(k2, (draft_tokens.shape[0], target_probs.shape[-1]))  # race_u
    return spec_verify_reference(draft_tokens, draft_probs, target_probs, verify_len, u, w)


@dataclass(frozen=True)
class AuditCheck:
    """One check. p_value is raw; p_adjusted = min(1, m p_value) (Bonferroni over m)."""

    name: str
    case: str
    statistic: float
    dof: int
    p_value: float
    p_adjusted: float
    log10_p: float  # log10 of the raw p (p underflows to 0 for G beyond ~1500)
    observed: np.ndarray
    expected: np.ndarray
    passed: bool
    labels: tuple[str, ...] = ()  # row labels of 2-D tables (strata)
    note: str = ""


@dataclass(frozen=True)
class AuditReport:
    """Verdict: passed iff every check's adjusted p-value >= alpha; p_value = min adjusted."""

    passed: bool
    p_value: float
    alpha: float
    tests: list[AuditCheck]
    vocab_size: int
    k: int
    num_samples: int
    seed: int
    verifier_name: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> list[AuditCheck]:
        return [t for t in self.tests if not t.passed]

    @property
    def log10_p_value(self) -> float:
        """log10 of the smallest adjusted p-value, finite where p_value underflows to 0."""
        return min(0.0, min(t.log10_p for t in self.tests) + math.log10(len(self.tests)))

    def format(self, detail: str = "failed") -> str:
        """Verdict, a one-line-per-check table, then observed/expected tables: of failed checks
        ("failed"), or also of every passed pooled and A|L test ("all")."""
        from v41jax.speculative.audit_text import format_report

        return format_report(self, detail)

    def summary(self, max_failed: int = 6) -> str:
        """Verdict, then one line per case: its checks, how many failed, and its worst check
        (smallest p); `format` lists every check."""
        from v41jax.speculative.audit_text import summarize_report

        return summarize_report(self, max_failed)


@dataclass(frozen=True)
class _Case:
    """Fixed tables: p [K+1, V] target; g [K, V] the law drafts are drawn from (given to the
    verifier as draft_probs iff pass_q; else None = one-hot drafts); L = K or uniform [0, K]."""

    name: str
    p: np.ndarray
    g: np.ndarray
    pass_q: bool
    random_len: bool

    def beta(self) -> np.ndarray:
        """Per-draft acceptance probability, float64 [K] (equation (2))."""
        p, g = self.p[:-1].astype(np.float64), self.g.astype(np.float64)
        return np.minimum(p, g).sum(-1) if self.pass_q else (p * g).sum(-1)


def make_cases(vocab_size: int, k: int, seed: int) -> list[_Case]:
    """The audit's cases (a) .. (f); all tables seeded from `seed`."""
    v = vocab_size
    rng = np.random.default_rng(seed)
    # Dirichlet rows with a 10% uniform floor: every support cell has p >= 0.1/V, so expected
    # counts stay large at 10^4..10^5 samples and the chi-square approximation holds.
    tab = lambda rows: 0.9 * rng.dirichlet(np.ones(v), size=rows) + 0.1 / v
    # normalised float32 rows: what the verifier sees, and what the exact laws are computed from
    _f32 = lambda x: (x / x.sum(-1, keepdims=True)).astype(np.float32)
    cases = [
        _Case("random", _f32(tab(k + 1)), _f32(tab(k)), True, False),
        _Case("random_len", _f32(tab(k + 1)), _f32(tab(k)), True, True),
    ]
    # (c) a drafted token the target forbids (p_j(z) = 0 < q_j(z): it must never be emitted) and
    # a token the drafter never proposes (q_j(w) = 0 < p_j(w): only the residual can emit it).
    p, q = tab(k + 1), tab(k)
    zw = np.array([rng.choice(v, size=2, replace=False) for _ in range(k + 1)])  # z != w
    p[np.arange(k + 1), zw[:, 0]] = 0.0
    q[np.arange(k), zw[:k, 1]] = 0.0
    cases.append(_Case("target_zero", _f32(p), _f32(q), True, True))
    # (d) greedy drafts: the same fixed token argmax q_j in every row, draft_probs=None.
    onehot = np.eye(v)[np.argmax(tab(k), -1)]
    cases.append(_Case("greedy_onehot", _f32(tab(k + 1)), _f32(onehot), False, True))
    # (e) one-hot drafts varying by row, draft_probs=None: exact for any draft law g. g is not
    # uniform: with uniform g, "residual from p" happens to emit exactly p (g(v) p(v) +
    # p(v) (1 - sum g p) = p(v) iff g(v) = sum_w g(w) p(w)), hiding that bug in this case.
    cases.append(_Case("mixed_onehot", _f32(tab(k + 1)), _f32(tab(k)), False, False))
    # (f) q ~= p: acceptance ~0.97, so the all-accepted bonus path dominates.
    p = tab(k + 1)
    q = p[:k] * np.exp(0.1 * rng.standard_normal((k, v)))
    cases.append(_Case("near_identical", _f32(p), _f32(q), True, False))
    return cases


def _run_case(fn, case: _Case, n: int, key, rng, chunk: int):
    """Drafts d [N, K], lengths L [N], verifier outputs out [N, K+1], A [N] (numpy)."""
    k, v = case.g.shape
    n_chunks = max(1, math.ceil(n / chunk))
    size = math.ceil(n / n_chunks)  # equal chunks: one compilation per case shape
    p_dev = jnp.asarray(np.broadcast_to(case.p, (size, k + 1, v)))
    q_dev = jnp.asarray(np.broadcast_to(case.g, (size, k, v))) if case.pass_q else None
    g64, parts = case.g.astype(np.float64), []
    for c in range(n_chunks):
        d = np.stack([rng.choice(v, size, p=g64[j] / g64[j].sum()) for j in range(k)], 1)
        ell = rng.integers(0, k + 1, size) if case.random_len else np.full(size, k)
        d, ell = jnp.asarray(d.astype(np.int32)), jnp.asarray(ell.astype(np.int32))
        out, acc = (np.asarray(x) for x in fn(jax.random.fold_in(key, c), d, q_dev, p_dev, ell))
        if out.shape != (size, k + 1) or acc.shape != (size,):
            raise ValueError(f"verifier returned shapes {out.shape}, {acc.shape}")
        parts.append((np.asarray(d), np.asarray(ell), out, acc))
    return tuple(np.concatenate(x) for x in zip(*parts, strict=True))


def _g_test(obs: np.ndarray, exp: np.ndarray) -> tuple[float, int, float, int]:
    """(G, dof, p, count in zero-probability cells); rows are independent strata."""
    obs, exp = np.atleast_2d(obs).astype(np.float64), np.atleast_2d(exp)
    support = exp > 0
    impossible = int(obs[~support].sum())
    g = 2.0 * float((xlogy(obs, obs) - xlogy(obs, np.where(support, exp, 1.0)))[support].sum())
    dof = int((support.sum(1) - 1).clip(0).sum())
    p = 0.0 if impossible else (float(stats.chi2.sf(g, dof)) if dof > 0 else 1.0)
    return g, dof, p, impossible


def _chi2_log10_sf(g: float, dof: int) -> float:
    """log10 P(chi2_dof > g) where scipy underflows: Gamma(a, x) = x^(a-1) e^-x (1 + (a-1)/x
    + (a-1)(a-2)/x^2 + ..), a = dof/2, x = g/2 >> a (asymptotic; for display only)."""
    a, x = dof / 2, g / 2
    series = 1.0 + np.cumprod([(a - i) / x for i in range(1, 12)]).sum()
    return ((a - 1) * math.log(x) - x + math.log(series) - math.lgamma(a)) / math.log(10)


def audit_check(name, case, obs, exp, labels=(), note="", bad=None) -> dict:
    """A G-test's fields for AuditCheck; `bad` (validity) replaces the test: p = 0 iff bad."""
    if bad is None:
        g, dof, p, impossible = _g_test(obs, exp)
        if impossible:
            note = (note + "; " if note else "") + f"{impossible} in probability-0 cells"
    else:
        g, dof, p, impossible = float(bad), 0, float(not bad), bad
    # log10 p, finite where p underflows to 0 (-inf only for counts in impossible cells)
    tiny = not impossible and p < 1e-300
    log10_p = _chi2_log10_sf(g, dof) if tiny else math.log10(p) if p else -math.inf
    return dict(
        name=name,
        case=case,
        statistic=g,
        dof=dof,
        p_value=p,
        log10_p=log10_p,
        observed=np.asarray(obs),
        expected=np.asarray(exp),
        labels=tuple(labels),
        note=note,
    )


def validity_check(case: _Case, d, ell, out, acc) -> dict:
    """Row counts of each kind of malformed output (see the module docstring)."""
    (n, k1), v = out.shape, case.p.shape[1]
    pos = np.arange(k1)[None, :]
    a = np.clip(acc, 0, k1 - 1)[:, None]
    bad_a = (acc < 0) | (acc > ell)
    d_pad = np.concatenate([d, np.zeros((n, 1), d.dtype)], 1)
    prefix = ((pos < a) & (out != d_pad)).any(1)
    tok = np.take_along_axis(out, a, 1)[:, 0]
    rng_bad = (tok < 0) | (tok >= v)
    tail = ((pos > a) & (out != -1)).any(1)
    counts = np.array([bad_a.sum(), prefix.sum(), rng_bad.sum(), tail.sum()], np.float64)
    bad = int((bad_a | prefix | rng_bad | tail).sum())
    note = f"{bad} malformed rows" if bad else ""
    return audit_check("validity", case.name, counts, np.zeros(4), note=note, bad=bad)


def position_law_checks(case: _Case, ell, out, acc) -> list[dict]:
    """Equation (1) at each position j: pooled, then stratified by (L, previous token)."""
    (k1, v), checks = case.p.shape, []
    a = np.clip(acc, 0, k1 - 1)  # an invalid A fails validity; clipped, the laws stay defined
    for j in range(k1):
        rows = a >= j
        tok = out[rows, j]
        cell = np.where((tok >= 0) & (tok < v), tok, v)  # v = the out-of-range cell
        law = np.append(case.p[j].astype(np.float64), 0.0)
        obs = np.bincount(cell, minlength=v + 1).astype(np.float64)
        checks.append(
            audit_check(f"law {j}", case.name, obs, obs.sum() * law, note=f"n={rows.sum()}")
        )
        prev = out[rows, j - 1] if j > 0 else np.full(rows.sum(), -1)
        prev = np.where((prev >= -1) & (prev < v), prev, v) + 1  # -1 (no previous) .. v
        stratum = ell[rows] * (v + 2) + prev
        table = np.bincount(stratum * (v + 1) + cell, minlength=k1 * (v + 2) * (v + 1))
        table = table.reshape(-1, v + 1).astype(np.float64)  # [L, h] strata x tokens
        keep = np.flatnonzero(table.sum(1) > 0)
        if keep.size <= 1:
            continue  # a single stratum is the pooled test again
        labels = [f"L={s // (v + 2)},h={s % (v + 2) - 1}" for s in keep]
        table = table[keep]
        table, labels, note = merge_small_strata(table, labels, law)
        exp = table.sum(1, keepdims=True) * law
        checks.append(audit_check(f"law {j}|L,h", case.name, table, exp, labels, note))
    return checks


def _acceptance_laws(case: _Case, ell, acc) -> list[dict]:
    """Equation (2): the law of A given each verify length L >= 1 (L = 0 forces A = 0)."""
    beta, checks = case.beta(), []
    for length in np.unique(ell[ell >= 1]):
        reach = np.concatenate([[1.0], np.cumprod(beta[:length])])  # P(A >= j), j = 0..L
        law = np.append(reach[:-1] - reach[1:], reach[-1])  # P(A = j) = P(>= j) - P(>= j+1)
        a = acc[ell == length]
        cell = np.where((a >= 0) & (a <= length), a, length + 1)
        obs = np.bincount(cell, minlength=length + 2).astype(np.float64)
        exp = obs.sum() * np.append(law, 0.0)
        checks.append(audit_check(f"A|L={length}", case.name, obs, exp, note=f"n={a.size}"))
    return checks


def audit_verifier(
    verifier: Verifier,
    *,
    vocab_size: int = 6,
    k: int = 3,
    num_samples: int = 200_000,
    seed: int = 0,
    alpha: float = 1e-3,
    chunk: int = 50_000,
    jit: bool = True,
    name: str = "",
) -> AuditReport:
    """Audit `verifier(key, drafts, draft_probs | None, target_probs, verify_len)` on every
    case of `make_cases` with num_samples rows each; see the module docstring."""
    if vocab_size < 3 or k < 1:
        raise ValueError(f"the audit needs vocab_size >= 3 and k >= 1, got {vocab_size}, {k}")
    if num_samples < 1 or chunk < 1:
        raise ValueError(f"num_samples={num_samples} and chunk={chunk} must be >= 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} must lie in (0, 1)")
    start = time.perf_counter()
    fn = jax.jit(verifier) if jit else verifier
    key = jax.random.PRNGKey(seed)
    raw: list[dict] = []
    for i, case in enumerate(make_cases(vocab_size, k, seed)):
        rng = np.random.default_rng([seed, i])
        d, ell, out, acc = _run_case(fn, case, num_samples, jax.random.fold_in(key, i), rng, chunk)
        raw.append(validity_check(case, d, ell, out, acc))
        raw += position_law_checks(case, ell, out, acc)
        raw += _acceptance_laws(case, ell, acc)
    meta = dict(vocab_size=vocab_size, k=k, num_samples=num_samples, seed=seed)
    return make_report(raw, alpha, verifier, name, start, **meta)


def make_report(raw: list[dict], alpha: float, fn, name: str, start: float, **meta) -> AuditReport:
    """Verdict over `raw` checks: each passes iff min(1, m p) >= alpha (Bonferroni, m checks)."""
    m = len(raw)
    tests = [
        AuditCheck(p_adjusted=(a := min(1.0, r["p_value"] * m)), passed=a >= alpha, **r)
        for r in raw
    ]
    return AuditReport(
        passed=all(t.passed for t in tests),
        p_value=min(t.p_adjusted for t in tests),
        alpha=alpha,
        tests=tests,
        verifier_name=name or getattr(fn, "__name__", repr(fn)),
        seconds=time.perf_counter() - start,
        **meta,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI (`v41jax.speculative.audit_cli`): print the report; 0 if the verifier passes."""
    from v41jax.speculative.audit_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())


def merge_small_strata(table, labels, law):
    """(table, labels, note) with the strata whose expected counts are below MIN_EXPECTED
    merged into one (kept if it is large enough, else skipped). Merging strata is valid: the
    law holds in each, hence in their union."""
    small = table.sum(1) * law[law > 0].min() < MIN_EXPECTED
    note = f"{(~small).sum()} strata"
    if small.any():
        merged = table[small].sum(0)
        table, labels = table[~small], [labels[i] for i in np.flatnonzero(~small)]
        if merged.sum() * law[law > 0].min() >= MIN_EXPECTED:
            table, labels = np.vstack([table, merged]), labels + ["merged"]
            note += f" + {small.sum()} merged"
        else:
            note += f", {int(merged.sum())} rows in {small.sum()} small strata skipped"
    return table, labels, note
