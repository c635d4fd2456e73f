"""Choose a function by the platform the program is LOWERED for (not the one it is traced on).

``platform_call(per_platform, default, *args)`` is one primitive with a lowering rule per
platform ("cpu", "tpu", "cuda"; anything else takes ``default``): each rule lowers only its
own function, so the Pallas kernel of the TPU rule is never lowered for CPU. A rule given
as a string is an error message, raised as ValueError when that platform is lowered (an
``impl="pallas"`` program lowered for CPU, or a shape that platform's kernel cannot take).

Why not ``lax.platform_dependent``: lowered for one platform it prunes the other branches,
but lowered for several at once (``lowering_platforms=("cpu", "tpu")``, export) it keeps
one branch per platform and lowers each kept branch for ALL of them, so a Pallas call in the
TPU branch is lowered for CPU too and fails ("Only interpret mode is supported on CPU").
Per-platform rules are lowered under a context narrowed to their platform.

The primitive has no JVP rule (the caller wraps it in a ``jax.custom_vjp``); under vmap
each platform's function is vmapped (a Pallas call then gets a grid axis for the batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

PLATFORMS = ("cpu", "tpu", "cuda")
Rule = Callable[..., Any] | str


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a primitive parameter
class _Rules:
    per_platform: dict[str, Rule]
    default: Rule
    in_tree: Any
    shape_fn: Callable[..., Any]
    out_avals: tuple


_platform_call_p = jex_core.Primitive("mhc_single_pass_platform_call")
_platform_call_p.multiple_results = True
_platform_call_p.def_abstract_eval(lambda *avals, rules: rules.out_avals)
_platform_call_p.def_impl(
    lambda *args, rules: jax.jit(lambda *a: _platform_call_p.bind(*a, rules=rules))(*args)
)


def _lowering_for(platform: str | None):
    def rule(ctx, *leaves, rules: _Rules):
        fn = rules.per_platform.get(platform, rules.default) if platform else rules.default
        if isinstance(fn, str):
            raise ValueError(fn)

        def flat(*xs):
            return jax.tree.leaves(fn(*jax.tree.unflatten(rules.in_tree, xs)))

        return mlir.lower_fun(flat, multiple_results=True)(ctx, *leaves)

    return rule


mlir.register_lowering(_platform_call_p, _lowering_for(None))
for _p in PLATFORMS:
    mlir.register_lowering(_platform_call_p, _lowering_for(_p), platform=_p)


def _batch(leaves, dims, *, rules: _Rules):
    in_axes = jax.tree.unflatten(rules.in_tree, list(dims))
    wrap = lambda f: f if isinstance(f, str) else jax.vmap(f, in_axes=in_axes)
    args = jax.tree.unflatten(rules.in_tree, list(leaves))
    per_platform = {p: wrap(f) for p, f in rules.per_platform.items()}
    out = platform_call(per_platform, wrap(rules.default), wrap(rules.shape_fn), *args)
    outs = jax.tree.leaves(out)
    return outs, [0] * len(outs)


batching.primitive_batchers[_platform_call_p] = _batch


def platform_call(per_platform: dict[str, Rule], default: Rule, shape_fn: Callable, *args):
    """``per_platform[lowering platform](*args)`` (``default`` elsewhere); ``shape_fn`` gives
    the output structure (any function with the same outputs, traced abstractly)."""
    bad = set(per_platform) - set(PLATFORMS)
    if bad:
        raise ValueError(f"platform_call: platforms must be among {PLATFORMS}, got {sorted(bad)}")
    leaves, in_tree = jax.tree.flatten(args)
    out = jax.eval_shape(shape_fn, *args)
    out_leaves, out_tree = jax.tree.flatten(out)
    avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_leaves)
    rules = _Rules(dict(per_platform), default, in_tree, shape_fn, avals)
    return jax.tree.unflatten(out_tree, _platform_call_p.bind(*leaves, rules=rules))
