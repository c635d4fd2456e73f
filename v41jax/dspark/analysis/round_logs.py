"""Offline analysis of DSpark's per-round decoding logs (`DSparkOutput`, numpy arrays).

A log holds, for R rounds of B rows and a drafter block of K drafts:

    confidence float [R, B, K]  c[r, b, j-1] = the drafter's P(draft j accepted | drafts < j were)
    verify_len int   [R, B]     L: drafts verified that round (0 for inactive rows)
    accepted   int   [R, B]     A in [0, L]: drafts accepted
    active     bool  [R, B]     the row was still generating (one speculative round)

An active row-round emits A + 1 tokens. Draft j (1-based) was reached iff j <= L and A >= j - 1,
and accepted iff A >= j. From these:

    alpha_j  = #accepted_j / #reached_j                         (conditional acceptance, [K])
    E[A + 1] = 1 + sum_{j=1..k} prod_{i<=j} alpha_i             (`v41jax.speculative.throughput`)
    ECE      = sum_bins (n_bin / N) |acceptance_bin - confidence_bin|   over reached drafts
    E_c[A]   = sum_{j=1..L} prod_{i<=j} c_i                     (predicted accepted length)
    T_model  = sum_r cost(B (1 + max_b L[r, b]))                 (`modelled_seconds`)

Inactive row-rounds are ignored everywhere, whatever their values. Results are plain
JSON-able dicts and lists (None where a quantity has no samples). Plots use the Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from v41jax.speculative.throughput import expected_tokens_per_round

LOG_KEYS = ("confidence", "verify_len", "accepted", "active")
FIGSIZE = (4.5, 3.2)
DPI = 110


# ----------------------------------------------------------------------------- validation


def _as_int(name: str, x: Any) -> np.ndarray:
    a = np.asarray(x)
    # float logs (e.g. after a JSON round trip) are fine if they hold whole numbers
    if np.issubdtype(a.dtype, np.floating) and np.all(np.isfinite(a)) and np.all(a == a.round()):
        return a.astype(np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    return int(k)


def _check_rounds(verify_len, accepted, active, k: int):
    """(L, A, active) as int64 [R, B], int64 [R, B], bool [R, B]; A <= L <= k on active rows."""
    length, acc = _as_int("verify_len", verify_len), _as_int("accepted", accepted)
    act = np.asarray(active)
    if act.dtype != bool:
        raise ValueError(f"active must be bool, got dtype {act.dtype}")
    if length.ndim != 2 or acc.shape != length.shape or act.shape != length.shape:
        raise ValueError(
            f"verify_len, accepted, active must share one [R, B] shape, got "
            f"{length.shape}, {acc.shape}, {act.shape}"
        )
    # inactive rows are padding: only active ones must be a valid round
    for bad, what in (
        (act & ((length < 0) | (length > k)), f"verify_len outside [0, k={k}]"),
        (act & ((acc < 0) | (acc > length)), "accepted outside [0, verify_len]"),
    ):
        if bad.any():
            r, b = np.argwhere(bad)[0]
            raise ValueError(
                f"{what}: verify_len={length[r, b]}, accepted={acc[r, b]} at round {r}, row {b}"
            )
    return length, acc, act


def check_log(confidence, verify_len, accepted, active):
    """(c float64 [R, B, K], L, A, active [R, B], K), validated; c in [0, 1]."""
    c = np.asarray(confidence, np.float64)
    if c.ndim != 3 or c.shape[2] < 1:
        raise ValueError(f"confidence must be [R, B, K] with K >= 1, got shape {c.shape}")
    k = c.shape[2]
    length, acc, act = _check_rounds(verify_len, accepted, active, k)
    if c.shape[:2] != length.shape:
        raise ValueError(f"confidence {c.shape} does not match [R, B] = {length.shape}")
    if c.size and (not np.all(np.isfinite(c)) or c.min() < 0 or c.max() > 1):
        raise ValueError(f"confidence must lie in [0, 1], got range [{c.min()}, {c.max()}]")
    return c, length, acc, act, k


def _masks(length, acc, act, k: int) -> tuple[np.ndarray, np.ndarray]:
    """reached, accepted: bool [R, B, K]; draft j reached iff j <= L and A >= j - 1."""
    j = np.arange(1, k + 1)
    reached = act[..., None] & (j <= length[..., None]) & (acc[..., None] >= j - 1)
    return reached, reached & (acc[..., None] >= j)


# ----------------------------------------------------------------------------- acceptance


def acceptance_per_position(verify_len, accepted, active, k: int) -> tuple[np.ndarray, np.ndarray]:
    """alpha float64 [K] (#accepted_j / #reached_j, NaN where never reached), reached int64 [K].

    verify_len, accepted int [R, B]; active bool [R, B]; k = K, the drafter's block size.
    """
    k = _check_k(k)
    reached, acc = _masks(*_check_rounds(verify_len, accepted, active, k), k)
    n_reached = reached.sum((0, 1))
    n_acc = acc.sum((0, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        alpha = np.where(n_reached > 0, n_acc / np.maximum(n_reached, 1), np.nan)
    return alpha, n_reached.astype(np.int64)


def tokens_per_round(accepted, active) -> float:
    """Mean of A + 1 over the active row-rounds (NaN if none); accepted int [R, B]."""
    acc, act = _as_int("accepted", accepted), np.asarray(active, bool)
    if acc.shape != act.shape:
        raise ValueError(f"accepted {acc.shape} and active {act.shape} shapes differ")
    return float(np.mean(acc[act] + 1)) if act.any() else float("nan")


def predicted_tokens_per_round(alpha, k: int | None = None) -> float:
    """The throughput model at fixed length k: 1 + sum_{j=1..k} prod_{i<=j} alpha_i.

    alpha: a scalar or per-position rates [>= k] (the first k are used; k defaults to all).
    """
    a = np.asarray(alpha, np.float64)
    if a.ndim == 0:
        return expected_tokens_per_round(float(a), _check_k(k))
    k = a.shape[0] if k is None else _check_k(k)
    if a.ndim != 1 or a.shape[0] < k:
        raise ValueError(f"alpha must be [>= k={k}] per-position rates, got shape {a.shape}")
    if np.isnan(a[:k]).any():
        raise ValueError(f"alpha has NaN (never reached) positions among the first {k}: {a[:k]}")
    return expected_tokens_per_round(a[:k], k)


# ----------------------------------------------------------------------------- calibration


def modelled_seconds(verify_len, active, cost) -> float:
    """Seconds a padded engine spends on one batch's rounds by its cost table:
    sum over rounds with an active row of cost(B (1 + w_r)), w_r = max_b L[r, b] (every row
    is padded to the round's widest verify). `cost`: tokens -> seconds (a `CostTable`).
    The log must be one batch (not `merge_logs` of several). Tokens / this is a throughput
    free of the machine's drift: it compares verify-length policies on one measured curve."""
    length, act = _as_int("verify_len", verify_len), np.asarray(active, bool)
    if length.ndim != 2 or act.shape != length.shape:
        raise ValueError(f"verify_len {length.shape} and active {act.shape} must both be [R, B]")
    b = length.shape[1]
    rounds = act.any(axis=1)
    widths = np.where(act, length, 0).max(axis=1)[rounds]
    return float(sum(cost(b * (1 + int(w))) for w in widths))


def _none(x: float) -> float | None:
    return None if x != x else float(x)


def _binned(pred: np.ndarray, obs: np.ndarray, hi: float, bins: int, names: tuple[str, str]):
    """Equal-width bins of `pred` on [0, hi]: (table, sum_bins (n/N) |mean obs - mean pred|)."""
    idx = np.clip(np.floor(pred / hi * bins).astype(np.int64), 0, bins - 1)
    count = np.bincount(idx, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mp = np.bincount(idx, pred, bins) / count
        mo = np.bincount(idx, obs.astype(np.float64), bins) / count
    edges = np.linspace(0.0, hi, bins + 1)
    table = [
        {"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": int(count[i])}
        | {names[0]: _none(mp[i]), names[1]: _none(mo[i])}
        for i in range(bins)
    ]
    n = count.sum()
    ece = float(np.nansum(count / max(n, 1) * np.abs(mo - mp))) if n else None
    return table, ece


def calibration(confidence, verify_len, accepted, active, bins: int = 10) -> dict:
    """Calibration of the confidence head, as a JSON-able dict.

    confidence float [R, B, K]; verify_len, accepted int [R, B]; active bool [R, B].
    Per reached draft (r, b, j) the prediction c[r, b, j-1] against the outcome A >= j:
      "reliability": `bins` equal-width bins on [0, 1] (lo, hi, count, confidence, acceptance),
      "ece" = sum_bins (n_bin / N) |acceptance_bin - confidence_bin|, "ece_per_position" [K].
    Per active row-round the predicted length E_c[A] = sum_{j<=L} prod_{i<=j} c_i against A:
      "length": mean_predicted, mean_realised, "bins" on [0, K], "ece_tokens" (same formula
      in tokens) and "ece_fraction" = ece_tokens / K.
    """
    if isinstance(bins, bool) or not isinstance(bins, int | np.integer) or bins < 1:
        raise ValueError(f"bins={bins!r} must be an int >= 1")
    c, length, acc, act, k = check_log(confidence, verify_len, accepted, active)
    reached, ok = _masks(length, acc, act, k)
    names = ("confidence", "acceptance")
    table, ece = _binned(c[reached], ok[reached], 1.0, bins, names)
    per_pos = []
    for j in range(k):
        m = reached[..., j]
        per_pos.append(_binned(c[..., j][m], ok[..., j][m], 1.0, bins, names)[1])
    # survival of the drafter's own model, cut at the verified length L
    surv = np.cumprod(c, axis=-1) * (np.arange(1, k + 1) <= length[..., None])
    pred_len, real_len = surv.sum(-1)[act], acc[act].astype(np.float64)
    len_table, len_ece = _binned(pred_len, real_len, float(k), bins, ("predicted", "realised"))
    return {
        "n": int(reached.sum()),
        "ece": ece,
        "reliability": table,
        "ece_per_position": per_pos,
        "reached_per_position": reached.sum((0, 1)).astype(int).tolist(),
        "length": {
            "n_rounds": int(act.sum()),
            "mean_predicted": _none(pred_len.mean()) if pred_len.size else None,
            "mean_realised": _none(real_len.mean()) if real_len.size else None,
            "ece_tokens": len_ece,
            "ece_fraction": None if len_ece is None else len_ece / k,
            "bins": len_table,
        },
    }


# ----------------------------------------------------------------------------- merging


def merge_logs(logs: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """One log over several batches: logs[i] has LOG_KEYS with [R_i, B_i(, K)] arrays
    (`DSparkOutput._asdict()` works; other keys are dropped). Rows are concatenated (axis 1)
    after padding every log to R = max R_i with inactive rounds (L = A = 0, c = 0)."""
    if not logs:
        raise ValueError("merge_logs needs at least one log, got none")
    arrays = []
    for i, log in enumerate(logs):
        missing = [key for key in LOG_KEYS if key not in log]
        if missing:
            raise ValueError(f"log {i} lacks keys {missing}")
        c, length, acc, act, _ = check_log(*(log[key] for key in LOG_KEYS))
        arrays.append({"confidence": c, "verify_len": length, "accepted": acc, "active": act})
    ks = {a["confidence"].shape[2] for a in arrays}
    if len(ks) != 1:
        raise ValueError(f"logs have different block sizes K={sorted(ks)}")
    r_max = max(a["active"].shape[0] for a in arrays)

    def pad(x: np.ndarray) -> np.ndarray:
        # zeros are an inactive round: active False, L = A = 0
        return np.pad(x, [(0, r_max - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    return {key: np.concatenate([pad(a[key]) for a in arrays], axis=1) for key in LOG_KEYS}


# ----------------------------------------------------------------------------- tables


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]
) -> str:
    """A markdown table: columns are (key, header, format spec), e.g. ("ece", "ECE", ".3f");
    a missing / None / NaN cell prints "-". (`v41jax.sweep.tables._md` is private and takes
    pre-formatted cells, so this is the reusable one.)"""
    for col in columns:
        if len(col) != 3:
            raise ValueError(f"column {col!r} must be (key, header, format spec)")

    def cell(x: Any, fmt: str) -> str:
        if x is None or (isinstance(x, float) and x != x):
            return "-"
        return format(x, fmt) if fmt else str(x)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE)
    return plt, fig, ax


def _save(plt, fig, ax, path: str, title: str) -> str:
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_reliability(calib_by_name: Mapping[str, dict], path: str) -> str:
    """Reliability diagram: empirical acceptance vs mean confidence per non-empty bin, one line
    per drafter (`calibration(...)` dicts), and the diagonal of perfect calibration."""
    plt, fig, ax = _figure()
    ax.plot([0, 1], [0, 1], color="0.6", ls="--", lw=1, label="calibrated")
    for name, cal in calib_by_name.items():
        pts = [(b["confidence"], b["acceptance"]) for b in cal["reliability"] if b["count"]]
        if pts:
            x, y = zip(*pts, strict=True)
            ece = "-" if cal["ece"] is None else f"{cal['ece']:.3f}"
            ax.plot(x, y, marker="o", ms=3, lw=1, label=f"{name} (ECE {ece})")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="acceptance")
    return _save(plt, fig, ax, path, "reliability of the confidence head")


def plot_acceptance(alpha_by_name: Mapping[str, Sequence[float]], path: str) -> str:
    """Conditional acceptance alpha_j vs draft position j = 1..K, one line per drafter
    (NaN / None positions, never reached, are gaps)."""
    plt, fig, ax = _figure()
    for name, alpha in alpha_by_name.items():
        a = np.array([np.nan if v is None else v for v in alpha], np.float64)
        ax.plot(np.arange(1, a.size + 1), a, marker="o", ms=3, lw=1, label=name)
    ax.set(ylim=(0, 1.02), xlabel="draft position j", ylabel="P(accept j | j-1 accepted)")
    return _save(plt, fig, ax, path, "acceptance per position")


def plot_throughput(rows: Sequence[Mapping[str, Any]], path: str) -> str:
    """tokens/s vs batch size (log2 x), one line per name; rows: {name, batch, tokens_per_s}."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for row in rows:
        if not {"name", "batch", "tokens_per_s"} <= set(row) or row["batch"] < 1:
            raise ValueError(f"throughput row {dict(row)!r} needs name, batch >= 1, tokens_per_s")
    plt, fig, ax = _figure()
    for name in dict.fromkeys(r["name"] for r in rows):  # first-seen order
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["name"] == name)
        x, y = zip(*pts, strict=True)
        ax.plot(x, y, marker="o", ms=3, lw=1, label=str(name))
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in rows})
    if batches:  # label each measured batch size, not powers of two it may lack
        ax.set_xticks(batches)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="batch size", ylabel="tokens / s")
    return _save(plt, fig, ax, path, "decode throughput")
