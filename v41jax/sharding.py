"""The device mesh and the one table mapping logical axis names to mesh axes.

This is the only file that names mesh axes. Modules annotate parameters with logical names
(`nn.with_logical_partitioning`) and activations with `nn.with_logical_constraint`; the rules
below turn those names into `PartitionSpec`s over the mesh `(data, fsdp, tensor)`.

Parameter axis names (`embed`, `mlp`, `heads`, ...) are kept apart from activation axis names
(`act_*`, `batch`, `length`): under FSDP a weight's `embed` axis is split over `fsdp`, while an
activation's model axis is not (its batch axis is), so one name cannot serve both.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import linen as nn
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:  # config imports the feature configs, whose packages import this module
    from v41jax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # the leading axis of params stacked by the layer scan (v41jax.model.layout): every
    # device holds every layer's shard; the scan slices one layer per step.
    ("layers", None),
    # MoE expert stacks [E, D, F]: no expert-parallel mesh axis (yet), so the expert axis is
    # replicated and the weights shard over their embed/mlp axes like the dense FFN.
    ("experts", None),
    # Engram tables are row-sharded over every device: they are meant to outgrow one device,
    # and a lookup only ever moves the few rows its tokens address (v41jax/engram/sharded.py).
    ("engram_rows", ("data", "fsdp", "tensor")),
    ("engram_head_dim", None),
    ("engram_embed", None),
    ("engram_branch", None),
    ("engram_taps", None),
    # mHC coefficient params are tiny (n*C x (n^2 + 2n)): replicated, no all-gather needed.
    ("mhc_flat", None),
    ("mhc_coeff", None),
    ("mhc_gates", None),
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_streams", None),
    ("act_mlp", "tensor"),
    ("act_experts", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_length", None),
)


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Resolve the -1 axis; the product must divide the available device count."""
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh {cfg} does not divide the {num_devices} devices")
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) > num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape, strict=True))} needs {math.prod(shape)} devices, "
            f"only {num_devices} available"
        )
    return tuple(shape)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over the first prod(shape) of `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    grid = np.array(devices[: math.prod(shape)]).reshape(shape)
    return Mesh(grid, MESH_AXES)  # Auto axis types: XLA propagates shardings from constraints


def mesh_axes_of(logical_name: str) -> tuple[str, ...]:
    """The mesh axes a logical axis name maps to (empty when replicated)."""
    for name, axes in LOGICAL_AXIS_RULES:
        if name == logical_name:
            return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    raise KeyError(f"logical axis {logical_name!r} has no rule in LOGICAL_AXIS_RULES")


BATCH_MESH_AXES = ("data", "fsdp")


def split_axes(mesh, logical: str, *sizes: int) -> tuple[str, ...]:
    """The mesh axes (> 1 device) the rules give `logical`, if they divide every size; else
    () (the arrays are then whole on every device of those axes, never cut short)."""
    axes = tuple(a for a in mesh_axes_of(logical) if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in axes)
    return axes if all(size % n == 0 for size in sizes) else ()


def batch_shards(mesh) -> int:
    """How many ways the batch is split: the product of the mesh's batch axes present."""
    return math.prod(mesh.shape[a] for a in BATCH_MESH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [B, T, ...]: rows split over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_MESH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class ShardingWarning(UserWarning):
    """A parameter dimension its logical axis maps to mesh axes that do not divide it (the
    dimension is replicated instead; `tree_shardings`)."""


def tree_shardings(mesh: Mesh, boxed_tree) -> object:
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned` boxes.

    One step from the annotations: `nn.get_partition_spec` reads each box's logical axis
    names (scanned params carry the leading "layers" name), `nn.logical_to_mesh_sharding`
    maps them through `LOGICAL_AXIS_RULES`. Works on abstract trees (`jax.eval_shape` of an
    init, e.g. a whole train state whose optimizer moments were initialised from boxed
    params and so carry their param's boxes). Unboxed leaves (step counters, RNG keys,
    optimizer scalars) are replicated. The result has the unboxed tree's structure.

    A dimension whose mesh axes do not divide it is replicated along that dimension, with a
    `ShardingWarning` naming the leaves (by path), their shape, the logical axis and the
    mesh axes: never a silent replication. Mesh axes of size 1 are dropped from the specs.
    """
    specs = nn.get_partition_spec(boxed_tree)  # logical names; PartitionSpec() unboxed
    named = nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)
    bad: dict[tuple, list[str]] = {}  # (shape, dim, logical name, mesh axes) -> leaf paths

    def fit(path, leaf, logical, sharding):
        shape = tuple(getattr(nn.unbox(leaf), "shape", ()))
        if not isinstance(leaf, meta.AxisMetadata):  # unboxed: replicated
            return replicated(mesh)
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        names = tuple(logical) + (None,) * (len(shape) - len(logical))
        fixed = []
        for dim, (n, axes, name) in enumerate(zip(shape, spec, names, strict=True)):
            axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
            size = math.prod(mesh.shape[a] for a in axes_t)
            if size > 1 and n % size:
                bad.setdefault((shape, dim, name, axes_t), []).append(_path_str(path))
            fixed.append(axes if size > 1 and n % size == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*fixed))

    out = jax.tree_util.tree_map_with_path(
        fit, boxed_tree, specs, named, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
    )
    for (shape, dim, name, axes), paths in bad.items():
        # name the shallowest leaves (the params; their optimizer moments sit deeper)
        depth = min(p.count("/") for p in paths)
        named = [p for p in paths if p.count("/") == depth]
        more = len(paths) - len(named)
        more = f" (and {more} deeper leaves of that shape and axes)" if more else ""
        size = math.prod(mesh.shape[a] for a in axes)
        warnings.warn(
            f"{', '.join(named)}{more}: shape {list(shape)} dim {dim} (logical axis "
            f"{name!r}, size {shape[dim]}) is not divisible by mesh axes {axes} of size {size} "
            f"(mesh {dict(mesh.shape)}); replicated along dim {dim}",
            ShardingWarning,
            stacklevel=2,
        )
    return out


def _path_str(path) -> str:
    """'params/block_0/attn/q' from a key path (dict keys, attribute names, indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def axis_rules():
    """Context manager making the rules active for `nn.with_logical_constraint` in modules."""
    return nn.logical_axis_rules(LOGICAL_AXIS_RULES)
