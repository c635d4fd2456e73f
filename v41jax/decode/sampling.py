"""Next-token sampling: temperature, top-k, top-p (nucleus) and min-p over float32 logits.

`sampling_probs` is the one definition of the sampling distribution; `sample_logits` draws
from exactly it (`sample_probs`: inverse CDF, one uniform per row), so speculative decoding
can get q (drafter) and p (target) identically.
Order of operations: scale by 1/temperature, keep the top_k largest, keep the smallest
prefix (in descending order) whose mass reaches top_p, keep tokens whose probability is at
least min_p times the most likely one's, renormalise.
Temperature 0 is greedy: a one-hot distribution on the argmax (first index on ties).

The settings are one value, `SamplingParams` (checked when built: bad values raise ValueError
naming the value). Every field may be a Python number or an array (scalar or per-row [B], traced
inside a jit), so one jitted sampler serves all settings. Concrete settings also fix a
`SamplingPlan` at trace time: the stages they turn off (greedy rows' draw, the sort of top-k /
top-p, min-p's mask) are not traced at all, with the same result bit for bit; traced settings
keep every stage (the sort behind a runtime `lax.cond`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Scalar = float | int | jax.Array


def _concrete(value) -> np.ndarray | None:
    """The value as a numpy array, or None while it is traced."""
    if isinstance(value, jax.core.Tracer):
        return None
    return np.asarray(value)


def _check_number(name: str, value) -> np.ndarray | None:
    """The value as a numpy array (None while traced); ValueError unless it is numeric."""
    got = _concrete(value)
    if got is not None and (isinstance(value, str) or got.dtype.kind not in "biuf"):
        raise ValueError(f"{name}={value!r} must be a number or a numeric array")
    return got


@dataclass(frozen=True)
class SamplingParams:
    """How a next token is drawn from logits (`sampling_probs`), one value for every decoder.

    temperature: >= 0 and finite (0 = greedy: the argmax); top_k: >= 0 (0 = off);
    top_p: in (0, 1] (1 = off); min_p: in [0, 1] (0 = off). Each a Python number or an array,
    scalar or per-row [B]. Checked when built: a bad value raises ValueError naming it; traced
    values cannot be checked and are let through. A JAX pytree of its four fields, so a jitted
    decoding loop takes it as a traced argument (`as_arrays`: one compilation for all).
    The default is greedy decoding.
    """

    temperature: Scalar = 0.0
    top_k: Scalar = 0
    top_p: Scalar = 1.0
    min_p: Scalar = 0.0

    def __post_init__(self) -> None:
        t = _check_number("temperature", self.temperature)
        k = _check_number("top_k", self.top_k)
        p = _check_number("top_p", self.top_p)
        m = _check_number("min_p", self.min_p)
        if t is not None and not (np.all(np.isfinite(t)) and np.all(t >= 0)):
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0 (0 = greedy)")
        if k is not None and not np.all(k >= 0):
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if p is not None and not np.all((p > 0) & (p <= 1)):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if m is not None and not np.all((m >= 0) & (m <= 1)):
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (0 = off)")

    def as_arrays(self) -> SamplingParams:
        """The same settings as arrays (float32 temperature, int32 top_k, float32 top_p and
        min_p), so a jitted decoding loop traces them instead of compiling per value."""
        return _from_fields(
            jnp.asarray(self.temperature, jnp.float32),
            jnp.asarray(self.top_k, jnp.int32),
            jnp.asarray(self.top_p, jnp.float32),
            jnp.asarray(self.min_p, jnp.float32),
        )


def _from_fields(temperature, top_k, top_p, min_p) -> SamplingParams:
    """A SamplingParams without the check: the pytree's rebuild (its leaves may be tracers,
    placeholders or None inside JAX transformations)."""
    out = object.__new__(SamplingParams)
    for name, value in zip(_FIELDS, (temperature, top_k, top_p, min_p), strict=True):
        object.__setattr__(out, name, value)
    return out


_FIELDS = ("temperature", "top_k", "top_p", "min_p")
jax.tree_util.register_pytree_node(
    SamplingParams,
    lambda s: ((s.temperature, s.top_k, s.top_p, s.min_p), None),
    lambda _, leaves: _from_fields(*leaves),
)
GREEDY = SamplingParams()  # the decoders' default: the argmax token


def _per_row(value: Scalar, batch_shape: tuple[int, ...], dtype) -> jax.Array:
    """A scalar or per-row knob as an array broadcastable against [..., V]. A per-row [B]
    knob goes along the leading axis, also for logits [B, T, V] (every position of row b
    gets row b's setting; numpy broadcasting would align it with T instead)."""
    v = jnp.asarray(value, dtype)
    if v.ndim == 1 and len(batch_shape) > 1:
        v = v.reshape(v.shape + (1,) * (len(batch_shape) - 1))
    return jnp.broadcast_to(v, batch_shape)[..., None]


class SamplingPlan(NamedTuple):
    """Which stages of `sampling_probs` can change its result, fixed at trace time.

    Hashable, so a jit takes it as a static argument. greedy: True when every row is greedy
    (temperature <= 0), False when none is, None when unknown (traced) or mixed. top_k /
    top_p / min_p: False only when that filter is known to keep every token (top_k <= 0,
    top_p >= 1, min_p <= 0 in every row). A stage marked off is skipped, not computed and
    masked, and skipping it gives the same bits: each skipped stage is the identity there.
    """

    greedy: bool | None = None
    top_k: bool = True
    top_p: bool = True
    min_p: bool = True


GENERAL_PLAN = SamplingPlan()  # nothing known: every stage traced in


def sampling_plan(sampling: SamplingParams) -> SamplingPlan:
    """The `SamplingPlan` of these settings: decided from concrete (Python or numpy/jax array)
    values, scalar or per-row; a traced setting leaves its stage on (greedy None)."""
    t, k = _concrete(sampling.temperature), _concrete(sampling.top_k)
    p, m = _concrete(sampling.top_p), _concrete(sampling.min_p)
    greedy = None
    if t is not None and np.all(t <= 0):
        return SamplingPlan(greedy=True, top_k=False, top_p=False, min_p=False)
    if t is not None and np.all(t > 0):
        greedy = False
    return SamplingPlan(
        greedy=greedy,
        top_k=k is None or bool(np.any(k > 0)),
        top_p=p is None or bool(np.any(p < 1.0)),
        min_p=m is None or bool(np.any(m > 0)),
    )


def sampling_probs(
    logits_BxV: jax.Array, sampling: SamplingParams, *, plan: SamplingPlan | None = None
) -> jax.Array:
    """The sampling distribution, float32 [B, V] (rows sum to 1).

    With z = logits / temperature sorted descending and ranks r = 0, 1, ...:
    keep r < top_k (all if top_k = 0); among those, with p' = softmax(z over kept),
    keep r if sum_{r' < r} p'_{r'} < top_p (all if top_p = 1); keep v if
    softmax(z)_v >= min_p max softmax(z), i.e. z_v >= z_max + log(min_p) (all if min_p = 0);
    `probs = softmax(z over kept)`. Works on any leading shape [..., V].
    Ties are ordered by token id, so exactly top_k tokens survive top-k.
    plan: the stages to trace (default `sampling_plan(sampling)`, so Python-number settings
    skip the stages they turn off); a plan must be true of the settings' values.
    """
    plan = sampling_plan(sampling) if plan is None else plan
    logits = logits_BxV.astype(jnp.float32)
    batch_shape, v = logits.shape[:-1], logits.shape[-1]
    if plan.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    t = _per_row(sampling.temperature, batch_shape, jnp.float32)
    greedy = t <= 0
    z = logits / (t if plan.greedy is False else jnp.where(greedy, 1.0, t))
    keep = None
    if plan.top_k or plan.top_p:
        keep = _top_k_top_p_keep(z, sampling.top_k, sampling.top_p, plan)
    if plan.min_p:
        # min-p in log space: the most likely token always survives, so order does not matter.
        m = _per_row(sampling.min_p, batch_shape, jnp.float32)
        z_max = jnp.max(z, axis=-1, keepdims=True)
        keep_m = (m <= 0) | (z >= z_max + jnp.log(jnp.maximum(m, 1e-30)))
        keep = keep_m if keep is None else keep & keep_m
    probs = jax.nn.softmax(z if keep is None else jnp.where(keep, z, -jnp.inf), axis=-1)
    if plan.greedy is False:
        return probs
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def _top_k_top_p_keep(z, top_k: Scalar, top_p: Scalar, plan: SamplingPlan) -> jax.Array:
    """bool [..., V]: the tokens top-k then top-p keep of z [..., V] (the stages `plan` has)."""
    batch_shape, v = z.shape[:-1], z.shape[-1]
    k = _per_row(top_k, batch_shape, jnp.int32)
    p = _per_row(top_p, batch_shape, jnp.float32)

    def keep_fn(z):
        order_BxV = jnp.argsort(-z, axis=-1, stable=True)
        rank = jnp.arange(v, dtype=jnp.int32)
        keep_sorted = (k <= 0) | (rank < k) if plan.top_k else jnp.ones(z.shape, bool)
        if plan.top_p:
            z_sorted = jnp.take_along_axis(z, order_BxV, axis=-1)
            p_sorted = jax.nn.softmax(jnp.where(keep_sorted, z_sorted, -jnp.inf), axis=-1)
            mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
            keep_sorted &= (mass_before < p) | (p >= 1.0)
        return jnp.take_along_axis(keep_sorted, jnp.argsort(order_BxV, axis=-1), axis=-1)

    # The sort is most of the cost on CPU: skip it when no row filters (a real branch
    # unless vmapped, where both sides run and the result is the same).
    needs_sort = (jnp.any(k > 0) if plan.top_k else False) | (
        jnp.any(p < 1.0) if plan.top_p else False
    )
    return jax.lax.cond(needs_sort, keep_fn, lambda z: jnp.ones(z.shape, bool), z)


def sample_logits(
    rng: jax.Array,
    logits_BxV: jax.Array,
    sampling: SamplingParams,
    *,
    plan: SamplingPlan | None = None,
) -> jax.Array:
    """One token per row, int32 [B], drawn from `sampling_probs(logits, sampling, plan=plan)`.

    When every row is greedy (`plan.greedy`), the argmax itself: the inverse-CDF draw of a
    one-hot row always lands on its token, so skipping the draw changes no token.
    """
    plan = sampling_plan(sampling) if plan is None else plan
    if plan.greedy:
        return jnp.argmax(logits_BxV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    probs_BxV = sampling_probs(logits_BxV, sampling, plan=plan)
    return sample_probs(rng, probs_BxV)


def sample_probs(rng: jax.Array, probs_BxV: jax.Array) -> jax.Array:
    """One token per row from probabilities [..., V] (rows sum to ~1): int32 [...].

    Inverse CDF: with F = cumsum(probs) and one u ~ U[0, 1) per row, the token is the first
    v with F_v > u F_V, so v is drawn with probability probs_v / F_V (F_V = 1 up to float32
    rounding). One uniform per row instead of the V Gumbel draws of
    `jax.random.categorical` (V random numbers per row). A token with
    probability 0 is never drawn: F is flat there, and a u that rounds up to F_V (odds
    ~2^-24) falls back to the last token of positive probability, not past the vocabulary.
    """
    p = jnp.asarray(probs_BxV, jnp.float32)
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(rng, p.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    tok = jnp.sum(cdf <= u, axis=-1)
    last = p.shape[-1] - 1 - jnp.argmax(p[..., ::-1] > 0, axis=-1)  # last v with p_v > 0
    return jnp.minimum(tok, last).astype(jnp.int32)


def probs_fn(sampling: SamplingParams, plan: SamplingPlan | None = None):
    """`logits -> sampling_probs(logits, sampling)`: the one law both q and p are built with.
    plan: as in `sampling_probs` (default: from the settings, all stages when traced)."""
    return lambda logits: sampling_probs(logits, sampling, plan=plan)
