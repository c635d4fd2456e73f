"""`Metric`: a scalar the model reports, carrying how several microbatches combine it.

A step with gradient accumulation (`train.microbatches = k`) runs the forward pass k times,
once per microbatch, and each pass reports its own metrics. How k values become the step's
one value depends on what the metric is, which only the feature that computes it knows:

    "token_mean"  sum_i v_i * n_i / N   (a per-token mean: n_i the microbatch's loss tokens)
    "mean"        mean_i v_i            (a statistic of each microbatch's batch, e.g. MoE's)
    "max"         max_i v_i             (a worst case, e.g. mHC's largest composite gain)
    "sum"         sum_i v_i             (a count)

So a feature wraps each metric it hands up (`ModelOutput.metrics`) in a `Metric`, and the
training step combines them by `combine` without knowing their names. A pytree whose only
leaf is the value (`combine` is static), so it passes through jit, grad's aux and scan.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

COMBINE_RULES = ("token_mean", "mean", "max", "sum")


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Metric:
    """A metric's value (float32 [] per pass; stacked [k] by a scan over microbatches) and
    its `combine` rule (one of `COMBINE_RULES`, see the module docstring)."""

    value: jax.Array
    combine: str = "mean"

    def __post_init__(self):
        if self.combine not in COMBINE_RULES:
            raise ValueError(f"Metric combine={self.combine!r}; expected one of {COMBINE_RULES}")

    def tree_flatten(self):
        return (self.value,), self.combine

    @classmethod
    def tree_unflatten(cls, combine, children):
        return cls(children[0], combine)


def combine_metrics(per_micro: dict, share_K: jax.Array) -> dict[str, jax.Array]:
    """{name: float32 []} of one step from k microbatches' `Metric`s stacked [k];
    `share_K` = n_i / N, each microbatch's share of the batch's loss tokens."""
    out = {}
    for name, metric in per_micro.items():
        if not isinstance(metric, Metric):
            raise TypeError(
                f"metric {name!r} is a {type(metric).__name__}, not a Metric: wrap it as "
                f"Metric(value, combine) with combine one of {COMBINE_RULES}, so that "
                f"gradient accumulation knows how to combine its microbatches' values"
            )
        v = metric.value
        if metric.combine == "token_mean":
            out[name] = jnp.sum(v * share_K)
        elif metric.combine == "mean":
            out[name] = jnp.mean(v)
        elif metric.combine == "max":
            out[name] = jnp.max(v)
        else:
            out[name] = jnp.sum(v)
    return out


def metric_values(metrics: dict) -> dict[str, jax.Array]:
    """{name: value}: the `Metric`s of one pass unwrapped (plain values pass through)."""
    return {k: m.value if isinstance(m, Metric) else m for k, m in metrics.items()}
