"""Statistical audit of a whole drafting + scheduling + verifying pipeline.

`v41jax.speculative.audit` audits a verifier fed with drafts whose law it knows. A pipeline instead
drafts by itself (its draft law q is unknown to the audit), chooses its own verify lengths and
verifies: `pipeline(key, target_probs [N, K+1, V]) -> (drafts [N, K], out_tokens [N, K+1],
accepted [N], verify_len [N])`, with out = (d_0 .. d_{A-1}, t, -1 ..) as for a verifier.

Losslessness. With fixed target tables p_0 .. p_K (prefix-independent: the "target" samples
token j from p_j whatever came before), a lossless pipeline emits, at every position j <= A,

    P(token_j = v | position j emitted, history h of earlier emitted tokens, L) = p_j(v)   (1)

so the emitted stream is the target's, whatever the drafter and the lengths. The acceptance
law (equation (2) of the verifier audit) needs q and is not checked here.

Why the length may depend on draft-side information only. The exact verifier (Leviathan et al. 2023)
emits law p_j at position j given the accepted prefix provided that, conditional on that
prefix, the draft d_j was sampled from the q_j(. | d_<j) it is given, with fresh randomness,
and the verifier's uniforms are fresh. A length L keeps (1) if it is a function of information
W fixed before the drafts are sampled and independent of the target, such that given W (and
the history) the drafts are still sampled from q with fresh randomness: e.g. the confidences
of the drafter's parallel pass, turned into lengths by a scheduler, possibly across the whole
batch. Conditioning on L then leaves every d_j ~ q_j and the verifier exact for each value of
L. A length that depends on the target's probabilities of the sampled drafts (e.g. verify
while p_j(d_j) >= q_j(d_j)) selects rows by how good their drafts are for the target: given
L, d_j is no longer distributed as q_j, and (1) fails
(tests/speculative/test_speculative_pipeline_audit.py checks that the audit catches it). In
general so does a length computed from the sampled drafts.

Stopping rules (`strata="stopping"`). A length may also be a stopping rule: the decision to
verify draft j (1-based) reads only draft-side information fixed before d_j is sampled, e.g.
confidences c_1 .. c_j that read the earlier drafts (the DSpark paper's confidence head, arXiv
2607.05147, with the scheduler's admission="early_stop"). Once d_1 .. d_{j-1} are accepted they
are the emitted history, and d_j is drawn from q_j with fresh randomness whatever is decided,
so the emitted stream is the target's. But L itself is then not fixed before the drafts:
L = j means "stop after d_j", decided from c_{j+1}, a function of d_j, so (1) given L fails
at position j although the pipeline is lossless. What such a pipeline keeps is

    P(token_j = v | position j emitted, h, S_j) = p_j(v),     S_j = [L > j]              (1')

(0-based position j: S_j = 1 if token j comes from verifying a draft, 0 if it is the last one)

since S_j is decided from the history (and independent other rows). `strata="stopping"`
stratifies by (S_j, previous token) instead of (L, previous token); a length that reads later
drafts (a global argmax over such confidences) still fails it.

Checks, per case (fixed tables p, `chunk`-row batches, independent keys):
  validity    A in [0, L], out[:, :A] = drafts, out[:, A] in [0, V), out[:, A+1:] = -1;
  verify_len  L in [0, K] (any violation fails);
  law j       G-test of the emitted tokens at position j against (1), pooled;
  law j|L,h   the same, stratified by (L, previous emitted token) (strata "length"), or
  law j|S,h   by (S_j = [L > j], previous emitted token) (strata "stopping", (1')).
The decision is Bonferroni over all m checks, as in `audit_verifier`: a check passes if
min(1, m p) >= alpha.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from v41jax.speculative.audit import (
    AuditReport,
    audit_check,
    make_report,
    merge_small_strata,
    position_law_checks,
    validity_check,
)

Pipeline = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array, jax.Array]]


@dataclass(frozen=True)
class PipelineCase:
    """A fixed target table p [K+1, V] (float32, rows sum to 1), named for the report."""

    name: str
    p: np.ndarray


def make_pipeline_cases(vocab_size: int, k: int, seed: int) -> list[PipelineCase]:
    """The audit's target tables; all seeded from `seed`."""
    v = vocab_size
    rng = np.random.default_rng(seed)
    # Dirichlet rows with a 10% uniform floor (as audit.make_cases): every cell has p >= 0.1/V,
    # so expected counts stay large and the chi-square approximation of G holds.
    tab = lambda rows: 0.9 * rng.dirichlet(np.ones(v), size=rows) + 0.1 / v
    _f32 = lambda x: (x / x.sum(-1, keepdims=True)).astype(np.float32)
    cases = [PipelineCase("random", _f32(tab(k + 1)))]
    # a token the target forbids at each position: a draft of it must never be emitted
    p = tab(k + 1)
    p[np.arange(k + 1), rng.integers(0, v, k + 1)] = 0.0
    cases.append(PipelineCase("target_zero", _f32(p)))
    # peaked: ~70% on one token, so most drafts of a flat drafter are rejected or most of a
    # drafter aimed at it accepted; the rest share 30% (>= 0.3/V each: counts stay large)
    peak = np.eye(v)[rng.integers(0, v, k + 1)]
    cases.append(PipelineCase("peaked", _f32(0.7 * peak + 0.3 / v)))
    return cases


def _run_pipeline(fn, case: PipelineCase, k: int, n: int, key, chunk: int):
    """Drafts d [N, K], lengths L [N], outputs out [N, K+1], A [N] as numpy arrays."""
    v = case.p.shape[1]
    n_chunks = max(1, math.ceil(n / chunk))
    size = math.ceil(n / n_chunks)  # equal chunks: one compilation per case shape
    p_dev = jnp.asarray(np.broadcast_to(case.p, (size, k + 1, v)))
    parts = []
    for c in range(n_chunks):
        d, out, acc, ell = (np.asarray(x) for x in fn(jax.random.fold_in(key, c), p_dev))
        shapes = (d.shape, out.shape, acc.shape, ell.shape)
        if shapes != ((size, k), (size, k + 1), (size,), (size,)):
            raise ValueError(
                f"pipeline returned shapes {shapes}; expected drafts [N, K], out [N, K+1], "
                f"accepted [N], verify_len [N] with N={size}, K={k}"
            )
        parts.append((d, ell, out, acc))
    return tuple(np.concatenate(x) for x in zip(*parts, strict=True))


def _length_range(case: PipelineCase, k: int, ell) -> dict:
    """verify_len must lie in [0, K]: counts of rows below and above."""
    counts = np.array([(ell < 0).sum(), (ell > k).sum()], np.float64)
    bad = int(counts.sum())
    note = f"{bad} rows with L outside [0, {k}]" if bad else ""
    return audit_check("verify_len", case.name, counts, np.zeros(2), note=note, bad=bad)


def _stopping_laws(case: PipelineCase, ell, out, acc) -> list[dict]:
    """(1') at each position j: stratified by (S_j = [L > j], previous emitted token). The
    pooled law j is `position_law_checks`'s (the same test); strata too small for the G-test
    approximation are merged (valid: (1') holds in each stratum, hence in their union)."""
    (k1, v), checks = case.p.shape, []
    a = np.clip(acc, 0, k1 - 1)
    pooled = [c for c in position_law_checks(case, ell, out, acc) if "|" not in c["name"]]
    for j in range(k1):
        checks.append(pooled[j])
        rows = a >= j
        tok = out[rows, j]
        cell = np.where((tok >= 0) & (tok < v), tok, v)
        law = np.append(case.p[j].astype(np.float64), 0.0)
        prev = out[rows, j - 1] if j > 0 else np.full(rows.sum(), -1)
        prev = np.where((prev >= -1) & (prev < v), prev, v) + 1
        stratum = (ell[rows] > j).astype(np.int64) * (v + 2) + prev
        table = np.bincount(stratum * (v + 1) + cell, minlength=2 * (v + 2) * (v + 1))
        table = table.reshape(-1, v + 1).astype(np.float64)
        keep = np.flatnonzero(table.sum(1) > 0)
        if keep.size <= 1:
            continue
        labels = [f"S={s // (v + 2)},h={s % (v + 2) - 1}" for s in keep]
        table = table[keep]
        table, labels, note = merge_small_strata(table, labels, law)
        if len(table):  # every stratum small and skipped: nothing left to test
            exp = table.sum(1, keepdims=True) * law
            checks.append(audit_check(f"law {j}|S,h", case.name, table, exp, labels, note))
    return checks


def audit_pipeline(
    pipeline: Pipeline,
    *,
    vocab_size: int = 6,
    k: int = 3,
    num_samples: int = 100_000,
    seed: int = 0,
    alpha: float = 1e-3,
    chunk: int = 50_000,
    jit: bool = True,
    name: str = "",
    strata: str = "length",
) -> AuditReport:
    """Audit `pipeline(key, target_probs [N, K+1, V]) -> (drafts, out, accepted, verify_len)`
    on every case of `make_pipeline_cases`, num_samples rows each (module docstring).

    strata: "length" tests (1) given (L, previous token), for lengths fixed before the drafts
    are sampled; "stopping" tests (1') given ([L > j], previous token), for stopping rules."""
    if strata not in ("length", "stopping"):
        raise ValueError(f"strata={strata!r} is not one of ('length', 'stopping')")
    if vocab_size < 3 or k < 1:
        raise ValueError(f"the audit needs vocab_size >= 3 and k >= 1, got {vocab_size}, {k}")
    if num_samples < 1 or chunk < 1:
        raise ValueError(f"num_samples={num_samples} and chunk={chunk} must be >= 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} must lie in (0, 1)")
    start = time.perf_counter()
    fn = jax.jit(pipeline) if jit else pipeline
    key = jax.random.PRNGKey(seed)
    raw: list[dict] = []
    for i, case in enumerate(make_pipeline_cases(vocab_size, k, seed)):
        d, ell, out, acc = _run_pipeline(
            fn, case, k, num_samples, jax.random.fold_in(key, i), chunk
        )
        raw.append(validity_check(case, d, ell, out, acc))
        raw.append(_length_range(case, k, ell))
        # an L outside [0, K] already fails; clipped, the strata of (1) stay well defined
        laws = position_law_checks if strata == "length" else _stopping_laws
        raw += laws(case, np.clip(ell, 0, k), out, acc)
    meta = dict(vocab_size=vocab_size, k=k, num_samples=num_samples, seed=seed)
    return make_report(raw, alpha, pipeline, name, start, **meta)
