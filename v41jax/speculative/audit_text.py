"""Text of an `AuditReport`: the summary (one line per case) and the full listing.

Kept apart from the statistics (`v41jax.speculative.audit`) so each stays short;
`AuditReport.format` and `.summary` call these.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import xlogy

from v41jax.speculative.audit import AuditCheck, AuditReport


def format_report(self: AuditReport, detail: str = "failed") -> str:
    """Verdict, a one-line-per-check table, then observed/expected tables: of failed checks
    ("failed"), or also of every passed pooled and A|L test ("all")."""
    verdict = "PASSED" if self.passed else "FAILED"
    p_min = _p_str(self.p_value, self.log10_p_value)
    lines = [
        f"speculative verifier audit: {verdict}  {self.verifier_name}",
        f"V={self.vocab_size} K={self.k}, {self.num_samples} samples per case, seed "
        f"{self.seed}, {len(self.tests)} checks, Bonferroni alpha={self.alpha:g}, min "
        f"adjusted p={p_min}, {len(self.failed)} failed ({self.seconds:.1f} s)",
        "",
        f"{'case':<16}{'check':<14}{'G':>12}{'dof':>5}{'p':>11}{'p_adj':>11}  ok",
    ]
    for t in self.tests:
        lines.append(
            f"{t.case:<16}{t.name:<14}{t.statistic:>12.1f}{t.dof:>5}"
            f"{_p_str(t.p_value, t.log10_p):>11}{t.p_adjusted:>11.3g}  "
            + ("yes" if t.passed else "NO")
            + (f"  ({t.note})" if t.note else "")
        )
    for t in self.tests:
        if not t.passed or (detail == "all" and t.observed.ndim == 1 and t.dof):
            lines += ["", f"[{t.case}] {t.name}: observed / expected"] + _table(t)
    lines += ["", f"verdict: {verdict} (min adjusted p = {p_min})"]
    return "\n".join(lines)


def summarize_report(self: AuditReport, max_failed: int = 6) -> str:
    """Verdict, then one line per case: its checks, how many failed, and its worst check
    (smallest p); `format` lists every check."""
    verdict = "PASSED" if self.passed else "FAILED"
    p_min = _p_str(self.p_value, self.log10_p_value)
    lines = [
        f"speculative verifier audit: {verdict}  {self.verifier_name}",
        f"V={self.vocab_size} K={self.k}, {self.num_samples} samples per case, seed "
        f"{self.seed}, {len(self.tests)} checks, Bonferroni alpha={self.alpha:g} "
        f"({self.seconds:.1f} s)",
        "",
        f"{'case':<16}{'checks':>6}{'failed':>8}  {'worst check':<14}{'p':>11}{'p_adj':>11}  ok",
    ]
    for case in dict.fromkeys(t.case for t in self.tests):
        tests = [t for t in self.tests if t.case == case]
        worst = min(tests, key=lambda t: (t.log10_p, t.p_value))
        failed = sum(not t.passed for t in tests)
        lines.append(
            f"{case:<16}{len(tests):>6}{failed:>8}  {worst.name:<14}"
            f"{_p_str(worst.p_value, worst.log10_p):>11}{worst.p_adjusted:>11.3g}  "
            + ("NO" if failed else "yes")
        )
    if self.failed:
        names = [f"{t.case}/{t.name}" for t in self.failed]
        more = len(names) - max_failed
        lines += [
            "",
            "failed: " + ", ".join(names[:max_failed]) + (f" (+{more})" if more > 0 else ""),
        ]
    lines += [
        "",
        f"verdict: {verdict} (min adjusted p = {p_min}; {len(self.failed)} of "
        f"{len(self.tests)} checks failed); --verbose lists every check",
    ]
    return "\n".join(lines)


def _p_str(p: float, log10_p: float) -> str:
    """p, or 1e<log10 p> where p underflowed to 0 ("0" only for impossible counts)."""
    return f"1e{log10_p:.0f}" if p == 0.0 and math.isfinite(log10_p) else f"{p:.3g}"


def _table(t: AuditCheck, max_rows: int = 8) -> list[str]:
    """Rows of observed/expected counts; for strata, the max_rows with the largest G terms."""
    obs, exp = np.atleast_2d(t.observed), np.atleast_2d(t.expected)
    labels = t.labels or ("",) * len(obs)
    cols = [f"{'A' if t.name[0] == 'A' else 'v'}={i}" for i in range(obs.shape[1] - 1)]
    cols += ["invalid"]  # out-of-range tokens, or A outside [0, L]
    cols = ["A!in[0,L]", "prefix!=d", "token!in[V]", "tail!=-1"] if t.name == "validity" else cols
    g = 2 * (xlogy(obs, obs) - xlogy(obs, np.where(exp > 0, exp, 1))).sum(1)
    order = np.argsort(-g)[:max_rows]
    out = ["  " + f"{'':<14}" + "".join(f"{c:>12}" for c in cols)]
    for i in order:
        out.append("  " + f"{labels[i] + ' obs':<14}" + "".join(f"{x:>12.0f}" for x in obs[i]))
        out.append("  " + f"{labels[i] + ' exp':<14}" + "".join(f"{x:>12.1f}" for x in exp[i]))
    return out
