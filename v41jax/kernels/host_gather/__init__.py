"""Native row gather from a host-memory Engram table on the CPU backend (an XLA FFI call).

    rows[..., :] = dequantise(table[ids[...], :])        float32 [*ids.shape, C]

for a table in host memory or a memory-mapped file: float32, bfloat16, or float8_e4m3fn with
a float32 row scale [R] or V4.1's uint8 UE8M0 block exponents [R, C / block]. The results
equal `HostTable.gather`'s bit for bit (fp8 decodes through numpy's own conversion table and
each product is one float32 multiply).

Why native: a `jax.pure_callback` costs a trip into Python per call, which at decode batch
sizes is several times the gather itself; an FFI custom call is a plain C function call
inside the compiled program. The C++ source (`host_gather.cc`) is compiled on first use
with the system's C++ compiler against jaxlib's FFI headers and cached under
`$V41JAX_CACHE/native` (default ~/.cache/v41jax/native). Where that is impossible (no
compiler; a GPU or TPU backend, where the host table must be read by a callback anyway)
`available()` is False and callers keep the callback. `V41JAX_HOST_GATHER=callback` turns
the native path off, `=native` makes a failed build an error instead of a fallback.

The table's address is embedded in the compiled program: `NativeTable` keeps the arrays
alive, and they must not be resized or freed while programs that use them exist (decoding
and evaluation only read them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import threading
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("host_gather.cc")
TARGET = "v41jax_host_gather"
MODES = ("auto", "native", "callback")
KINDS = {"float32": 0, "bfloat16": 1, "fp8_row_scale": 2, "fp8_blocks": 3}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# numpy's float8_e4m3fn -> float32 for every bit pattern: the host gather's exact values
FP8_LUT = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)

_lock = threading.Lock()
_status: dict[str, object] = {}  # "ok": bool, "why": str


def mode() -> str:
    m = os.environ.get("V41JAX_HOST_GATHER", "auto")
    if m not in MODES:
        raise ValueError(f"V41JAX_HOST_GATHER={m!r} must be one of {MODES}")
    return m


def _library_path() -> pathlib.Path:
    root = os.environ.get("V41JAX_CACHE") or os.path.expanduser("~/.cache/v41jax")
    key = hashlib.sha256(SOURCE.read_bytes() + jax.__version__.encode()).hexdigest()[:16]
    return pathlib.Path(root) / "native" / f"host_gather-{key}.so"


def build() -> pathlib.Path:
    """Compile `host_gather.cc` (once per source and jax version) and return the library."""
    lib = _library_path()
    if lib.is_file():
        return lib
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX) to build the native host gather")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [
        cxx,
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++17",
        f"-I{jax.ffi.include_dir()}",
        str(SOURCE),
        "-o",
        str(tmp),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(
            f"building the native host gather failed: {' '.join(cmd)}\n{done.stderr[-2000:]}"
        )
    os.replace(tmp, lib)  # atomic: concurrent builders (test workers) never see half a file
    return lib


def available() -> bool:
    """Whether `gather` can be used now: CPU backend, not turned off, library built and
    registered (built on the first call; a failure warns once and returns False)."""
    if mode() == "callback" or jax.default_backend() != "cpu":
        return False
    with _lock:
        if "ok" not in _status:
            try:
                import ctypes

                handler = ctypes.cdll.LoadLibrary(str(build())).V41jaxHostGather
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
                _status.update(ok=True, why="")
            except Exception as e:  # no compiler or headers: the callback still works
                _status.update(ok=False, why=str(e))
                if mode() == "native":
                    raise
                warnings.warn(
                    f"native host gather unavailable, using a callback: {e}", stacklevel=3
                )
    return bool(_status["ok"])


@dataclasses.dataclass(frozen=True, eq=False)
class NativeTable:
    """A host table in a format `gather` reads: values [R, C] (C-contiguous) and for fp8
    the row scale [R] float32 or the block exponents [R, C / block] uint8."""

    values: np.ndarray
    scale: np.ndarray | None
    kind: int
    block: int

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    @classmethod
    def from_arrays(cls, values, scale=None) -> NativeTable | None:
        """The native form of (values, scale), or None for a layout it does not read (other
        dtypes, non-contiguous arrays): the caller then reads the rows by callback."""
        if not isinstance(values, np.ndarray) or values.ndim != 2:
            return None
        arrays = [values] + ([] if scale is None else [scale])
        if not all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays):
            return None
        dt = values.dtype
        if scale is None and dt in (np.float32, np.dtype(ml_dtypes.bfloat16)):
            return cls(values, None, KINDS[dt.name], 0)
        if dt != FP8 or scale is None:
            return None
        if scale.dtype == np.float32 and scale.shape == (values.shape[0],):
            return cls(values, scale, KINDS["fp8_row_scale"], 0)
        blocks = scale.shape[1] if scale.ndim == 2 else 0
        if (
            scale.dtype == np.uint8
            and blocks
            and scale.shape[0] == values.shape[0]
            and values.shape[1] % blocks == 0
        ):
            return cls(values, scale, KINDS["fp8_blocks"], values.shape[1] // blocks)
        return None


def gather(table: NativeTable, ids) -> jax.Array:
    """ids int [...] -> float32 [..., C], read from host memory inside the compiled program.
    Ids outside [0, R) fail the call with an error naming the id. Needs `available()`."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"host_gather: ids must be integers, got {ids.dtype}")
    out = jax.ShapeDtypeStruct((*ids.shape, table.dim), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="expand_dims")
    scale = 0 if table.scale is None else table.scale.ctypes.data
    return call(
        ids.astype(jnp.int32),
        jnp.asarray(FP8_LUT),
        data=np.uint64(table.values.ctypes.data),
        scale=np.uint64(scale),
        num_rows=np.int64(table.num_rows),
        dim=np.int64(table.dim),
        kind=np.int64(table.kind),
        block=np.int64(table.block),
    )


__all__ = ["FP8_LUT", "MODES", "NativeTable", "available", "build", "gather", "mode"]
