"""Which blocks run under one `nn.scan`, and conversion of trees between the two layouts.

With `ModelConfig.scan_layers` the blocks are grouped into segments: maximal runs of
consecutive layers whose params have the same structure run as one `nn.scan` (params,
sown intermediates and KV caches stacked on a leading "layers" axis of length L_run). A layer
starts a new segment when its FFN kind differs from the previous one (MoE vs dense), and is a
segment of its own when it has an Engram module (its tables differ per layer) or, in mHC
form "single_pass", when it is layer 0 (its input state has no pending update, every later
block's has: a scan carry must keep one structure). Names say which layers a segment holds:

    "layers_{a}_{b}"   a scanned run of layers a..b (inclusive), leaves [b - a + 1, ...]
    "block_{i}"        one unscanned block (a run of length 1, or every layer without scan)

`convert_layout(tree, segments)` rewrites every dict in `tree` keyed by segment names (a param
tree, the Adam moments inside an optax state, sown intermediates, KV caches) into the given
segments, stacking or slicing along the leading axis. It reads only the names, so it turns
a tree of either layout (or a mix) into either. Abstract leaves (`jax.ShapeDtypeStruct`,
with a `NamedSharding`) convert too, so a restore target can be built for the other layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from v41jax.config import ModelConfig
from v41jax.model.moe import is_moe_layer

_NAME = re.compile(r"^(?:block_(\d+)|layers_(\d+)_(\d+))$")


class Segment(NamedTuple):
    """Layers `start .. stop - 1` as one module named `name`; `ffn_kind` "dense" or "moe"."""

    name: str
    start: int
    stop: int
    ffn_kind: str

    @property
    def scanned(self) -> bool:
        return self.stop - self.start > 1


def segment_name(start: int, stop: int) -> str:
    return f"block_{start}" if stop - start == 1 else f"layers_{start}_{stop - 1}"


def _alone(cfg: ModelConfig, layer: int) -> bool:
    single_pass = cfg.mhc.enabled and cfg.mhc.form == "single_pass"
    return layer in cfg.engram.layer_ids or (single_pass and layer == 0)


def layer_segments(cfg: ModelConfig, scan: bool | None = None) -> tuple[Segment, ...]:
    """The segments of `cfg` (module docstring); `scan` overrides `cfg.scan_layers`."""
    scan = cfg.scan_layers if scan is None else scan
    kinds = ["moe" if is_moe_layer(cfg, i) else "dense" for i in range(cfg.num_layers)]
    bounds = [0]
    for i in range(1, cfg.num_layers):
        if not scan or _alone(cfg, i) or _alone(cfg, i - 1) or kinds[i] != kinds[i - 1]:
            bounds.append(i)
    bounds.append(cfg.num_layers)
    return tuple(
        Segment(segment_name(a, b), a, b, kinds[a])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )


def unscanned_segments(num_layers: int) -> tuple[Segment, ...]:
    """One `block_{i}` segment per layer (the layout without scan; ffn_kind is not used)."""
    return tuple(Segment(f"block_{i}", i, i + 1, "") for i in range(num_layers))


def layer_range(name: str) -> tuple[int, int] | None:
    """(start, stop) of a segment name, None for other names."""
    m = _NAME.match(name)
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)), int(m.group(1)) + 1
    return int(m.group(2)), int(m.group(3)) + 1


def first_layer_of_path(path: tuple[str, ...]) -> int:
    """First block index of a param path ("block_3/..." -> 3, "layers_2_5/..." -> 2; every
    layer of a segment has the same kind); -1 outside the blocks."""
    r = layer_range(str(path[0])) if path else None
    return -1 if r is None else r[0]


# ----------------------------------------------------------------------------- leaf ops


def _slice_leaf(x: Any, j: int) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        s = x.sharding
        if isinstance(s, NamedSharding):
            s = NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)
    return x[j]


def _stack_leaves(*xs: Any) -> Any:
    x = xs[0]
    if isinstance(x, jax.ShapeDtypeStruct):
        s = x.sharding
        if isinstance(s, NamedSharding):
            s = NamedSharding(s.mesh, PartitionSpec(None, *tuple(s.spec)))
        return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=s)
    if isinstance(x, np.ndarray | np.generic):
        return np.stack(xs)
    return jnp.stack(xs)


# ----------------------------------------------------------------------------- trees


def is_layered(tree: Any) -> bool:
    """Whether `tree` is a dict with at least one segment-named key."""
    return isinstance(tree, Mapping) and any(layer_range(str(k)) for k in tree)


def _layer_subtrees(tree: Mapping) -> dict[int, Any]:
    """{layer: its subtree} of a layered dict (slices of the stacked segments)."""
    out = {}
    for key, sub in tree.items():
        r = layer_range(str(key))
        if r is None:
            continue
        a, b = r
        if str(key).startswith("block_"):
            out[a] = sub
        else:
            for j in range(b - a):
                out[a + j] = jax.tree.map(lambda x, j=j: _slice_leaf(x, j), sub)
    return out


def _convert_dict(tree: Mapping, segments: tuple[Segment, ...]) -> dict:
    layers = _layer_subtrees(tree)
    out = {k: v for k, v in tree.items() if layer_range(str(k)) is None}
    for seg in segments:
        subs = [layers[i] for i in range(seg.start, seg.stop) if i in layers]
        if not subs:  # e.g. intermediates: only some layers sow
            continue
        if len(subs) != seg.stop - seg.start:
            have = sorted(i for i in layers if seg.start <= i < seg.stop)
            raise ValueError(
                f"convert_layout: segment {seg.name} needs layers {seg.start}..{seg.stop - 1}, "
                f"the tree has {have}"
            )
        if seg.scanned:
            try:
                out[seg.name] = jax.tree.map(_stack_leaves, *subs)
            except ValueError as e:
                raise ValueError(
                    f"convert_layout: layers {seg.start}..{seg.stop - 1} of {seg.name} differ "
                    f"in structure and cannot be stacked: {e}"
                ) from e
        else:
            out[seg.name] = subs[0]
    extra = sorted(i for i in layers if not any(s.start <= i < s.stop for s in segments))
    if extra:
        raise ValueError(f"convert_layout: layers {extra} are outside every target segment")
    return out


def convert_layout(tree: Any, segments: tuple[Segment, ...]) -> Any:
    """`tree` with every layered dict (module docstring) rewritten into `segments`.

    Leaves keep their values: a scanned segment's leaf is `stack([leaf of layer a, ...])`,
    an unscanned one is the layer's own leaf (sliced out of a stacked segment when needed).
    Layered dicts are found anywhere in a pytree (optax states, train-state dataclasses).
    """
    return jax.tree.map(
        lambda x: _convert_dict(x, segments) if is_layered(x) else x, tree, is_leaf=is_layered
    )


def segments_of(names: Any) -> tuple[Segment, ...]:
    """The segments named by `names` (segment names; other names are skipped), in order."""
    ranges = sorted((r, str(n)) for n in names if (r := layer_range(str(n))))
    return tuple(Segment(n, a, b, "") for (a, b), n in ranges)


def scan_tree(cfg: ModelConfig, tree: Any) -> Any:
    """`tree` in the layout `Transformer(cfg)` uses (`layer_segments(cfg)`)."""
    return convert_layout(tree, layer_segments(cfg))


def unscan_tree(tree: Any, num_layers: int) -> Any:
    """`tree` with one "block_{i}" entry per layer (the layout without scan)."""
    return convert_layout(tree, unscanned_segments(num_layers))


def layout_of(tree: Any) -> tuple[str, ...]:
    """The sorted segment names of the first layered dict found in `tree` (() if none)."""
    found: list[tuple[str, ...]] = []

    def visit(x):
        if is_layered(x) and not found:
            found.append(tuple(sorted(str(k) for k in x if layer_range(str(k)))))
        return x

    jax.tree.map(visit, tree, is_leaf=is_layered)
    return found[0] if found else ()
