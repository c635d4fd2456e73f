"""Kernel choice by the platform a program is LOWERED for, not the default backend.

``by_platform(args, cpu=f, cuda=g, tpu=h)`` stages out every branch (as
``lax.platform_dependent``) and keeps only the branch of the lowering platform: a program
jitted on a CPU host and lowered for TPU gets the TPU kernel, one lowered for CPU never
lowers a Pallas TPU/GPU call. ``rocm`` takes the ``cuda`` branch unless given.

``unsupported(message, outs)`` is a branch body for a platform a choice cannot run on: it
traces to a placeholder of the right output shapes and raises ``ValueError(message)`` when
that platform's branch is lowered (or run eagerly). So one call can hold a kernel for TPU
and an error for CPU, and the error appears exactly when the program is lowered for CPU,
before any kernel is lowered.

Limit (JAX 0.10): lowering ONE program for several platforms at once
(``lowering_platforms=("cpu", "tpu")``, multi-platform ``jax.export``) fails when a branch
holds a Pallas call, because JAX lowers every branch for every platform of the module and
``pallas_call`` refuses CPU without ``interpret``; lowering for one platform (every jit on
a device) keeps only that platform's branch.

Shared by the kernel packages (engram_lookup, spec_verify, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

PLATFORMS = ("cpu", "cuda", "tpu")

# Scoped VMEM a TPU kernel gets without asking (16 MiB on v4/v5e, the smallest default),
# and the most a kernel here asks for: under the physical VMEM per core of v5p/v7x (64 MiB)
# and v5e/v6e (128 MiB), with room for Mosaic's own scratch. (v4 and older have 16 MiB in
# all; there a kernel asking for more fails in the TPU compiler, which runs on the TPU host.)
TPU_DEFAULT_SCOPED_VMEM = 16 << 20
TPU_MAX_VMEM = 48 << 20
# Elements of one Triton tensor (Triton's TRITON_MAX_TENSOR_NUMEL).
TRITON_MAX_NUMEL = 1 << 20


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tpu_vmem_bytes(rows: int, cols: int, dtype) -> int:
    """Bytes of a ``[rows, cols]`` VMEM buffer after (8 * packing, 128) tiling."""
    itemsize = np.dtype(dtype).itemsize
    return round_up(rows, 8 * max(1, 4 // itemsize)) * round_up(cols, 128) * itemsize


def tpu_vmem_limit(needed: int) -> int | None:
    """``vmem_limit_bytes`` for a kernel needing ``needed`` bytes: None (the default scope)
    when that holds it with a quarter to spare, else ``needed`` + 25%, rounded to MiB."""
    if needed <= TPU_DEFAULT_SCOPED_VMEM * 3 // 4:
        return None
    return round_up(needed + needed // 4, 1 << 20)


_unsupported_p = Primitive("kernel_unsupported_on_platform")
_unsupported_p.multiple_results = True


def _raise(*_, message: str, outs=None):
    raise ValueError(message)


_unsupported_p.def_impl(_raise)
_unsupported_p.def_abstract_eval(
    lambda *_, message, outs: [jax.core.ShapedArray(s, np.dtype(d)) for s, d in outs]
)
mlir.register_lowering(_unsupported_p, lambda ctx, *a, message, outs: _raise(message=message))


def unsupported(message: str, outs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """Placeholders shaped like ``outs``; lowering them raises ``ValueError(message)``."""
    spec = tuple((tuple(o.shape), np.dtype(o.dtype).name) for o in outs)
    return _unsupported_p.bind(message=message, outs=spec)


def by_platform(args: tuple, *, cpu: Callable, cuda: Callable, tpu: Callable, rocm=None):
    """``branch(*args)`` of the lowering platform (see the module docstring)."""
    return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, rocm=rocm or cuda, tpu=tpu)
