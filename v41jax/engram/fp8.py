"""FP8 Engram tables: float8_e4m3fn storage with one float32 scale per row (DeepSeek V4.1).

Format: ``q = RN_e4m3(x / s)``, ``s = max|row| / 448`` (448 = largest e4m3fn value; an
all-zero row gets ``s = 1`` and stays exactly zero), ``x_hat = q.astype(f32) * s``.

Training keeps a float32 (or bf16) master table and never differentiates FP8 storage.
Quantisation is per row, so it commutes with gathering rows::

    dequantize_rows(*quantize_rows(T))[ids] == fake_quantize_rows(T[ids])      (bitwise)

so the training forward gathers master rows and fake-quantises only the gathered
``[..., H, E]`` rows (O(1) work per token, straight-through gradient to the master), and
sees exactly what inference sees after ``export_fp8`` of the same master.

Error bound (derived in ``fp8_error_bound``): per element,
``|x_hat - x| <= (1 + 2^-18) * max(2^-4 |x|, 2^-10 s)``; relative ``2^-4`` wherever
``|x| >= 2^-6 s`` (the e4m3 normal range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0; a Python float so f32 math stays f32
_MANTISSA_BITS = 3  # e4m3: 3 stored bits, 4 significant bits
_MIN_NORMAL_EXP = -6  # smallest normal e4m3 value is 2^-6
# f32 rounding of x / s and q * s adds ~2^-23 relative; 2^-18 leaves ample room.
_F32_SLACK = 1.0 + 2.0**-18


def _row_scale(rows_xE: jax.Array) -> jax.Array:
    """``[..., E]`` -> ``[...]`` float32 scale ``max|row| / 448`` (1 for an all-zero row)."""
    amax = jnp.max(jnp.abs(rows_xE.astype(jnp.float32)), axis=-1)
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def _quantize_with_scale(rows_xE: jax.Array, scale: jax.Array) -> jax.Array:
    # The clip keeps an f32 rounding of max|row| / s just above 448 from overflowing to NaN
    # (e4m3fn has no infinity).
    y = rows_xE.astype(jnp.float32) / scale[..., None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_rows(table_RxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[R, E]`` float table -> (``[R, E]`` float8_e4m3fn, ``[R]`` float32 scale)."""
    if table_RxE.ndim != 2:
        raise ValueError(f"quantize_rows: table must be 2-D [R, E], got shape {table_RxE.shape}")
    scale_R = _row_scale(table_RxE)
    return _quantize_with_scale(table_RxE, scale_R), scale_R


def dequantize_rows(q_xE: jax.Array, scale: jax.Array) -> jax.Array:
    """``q.astype(f32) * scale[..., None]``: ``[..., E]`` fp8 and ``[...]`` scale -> f32."""
    if scale.shape != q_xE.shape[:-1]:
        raise ValueError(
            f"dequantize_rows: scale shape {scale.shape} must equal q shape without its last "
            f"axis, {q_xE.shape[:-1]}"
        )
    return q_xE.astype(jnp.float32) * scale[..., None]


@jax.custom_vjp
def fake_quantize_rows(rows_xE: jax.Array) -> jax.Array:
    """Quantise-dequantise each row ``[..., E]`` with its own scale; float32 out.

    Forward equals ``dequantize_rows(*quantize_rows(rows))`` row by row; the gradient is
    the identity (straight-through), so the master rows train as if unquantised.
    """
    scale = _row_scale(rows_xE)
    return dequantize_rows(_quantize_with_scale(rows_xE, scale), scale)


def _fake_quantize_fwd(rows_xE):
    # Residual: an empty array that only carries the input dtype for the cotangent cast.
    return fake_quantize_rows(rows_xE), jnp.zeros((0,), rows_xE.dtype)


def _fake_quantize_bwd(dtype_carrier, g):
    return (g.astype(dtype_carrier.dtype),)


fake_quantize_rows.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)


def export_fp8(table_RxE: jax.Array) -> dict[str, jax.Array]:
    """Master table -> inference storage ``{"q": [R, E] fp8, "scale": [R] f32}``."""
    q, scale = quantize_rows(table_RxE)
    return {"q": q, "scale": scale}


def import_fp8(stored: dict[str, jax.Array]) -> jax.Array:
    """Inverse of ``export_fp8`` up to the FP8 error: ``[R, E]`` float32."""
    return dequantize_rows(stored["q"], stored["scale"])


def convert_table(table_RxE: jax.Array, table_dtype: str) -> tuple[jax.Array, jax.Array | None]:
    """Master -> (stored table, row scale or None) for ``EngramConfig.table_dtype``.

    The pair feeds ``engram_lookup(table, ids, row_scale)`` directly.
    """
    if table_dtype in ("float32", "bfloat16"):
        return table_RxE.astype(table_dtype), None
    if table_dtype == "float8_e4m3fn":
        return quantize_rows(table_RxE)
    raise ValueError(
        f"convert_table: table_dtype must be float32, bfloat16 or float8_e4m3fn, "
        f"got {table_dtype!r}"
    )


def fp8_relative_error_bound() -> float:
    """``2^-4``: round-to-nearest relative error of e4m3 for values in its normal range.

    With 4 significant bits, a value in ``[2^e, 2^(e+1))`` rounds to a grid of spacing
    ``2^(e-3)``, so the error is at most ``2^(e-4) <= 2^-4 |y|``. It holds for elements with
    ``|x| >= 2^-6 * s`` (i.e. ``|x| >= max|row| * 2^-6 / 448``); smaller ones are subnormal
    in FP8 and have the absolute bound of ``fp8_error_bound`` instead.
    """
    return 2.0 ** -(_MANTISSA_BITS + 1)


def fp8_error_bound(x_xE: jax.Array, scale: jax.Array) -> jax.Array:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` for rows quantised with ``scale``.

    ``y = x / s`` lies in ``[-448, 448]``. Normal e4m3 (``|y| >= 2^-6``): error
    ``<= 2^-4 |y|``. Subnormal (``|y| < 2^-6``, spacing ``2^-9``): error ``<= 2^-10``.
    Back in x units and with both float32 roundings (``x / s`` and ``q * s``, ``2^-24``
    relative each) absorbed by the factor ``1 + 2^-18``::

        |x_hat - x| <= (1 + 2^-18) * max(2^-4 |x|, 2^-10 s)

    Assumes ``s`` is a normal float32 (``max|row| > ~1e-35``).
    """
    x = jnp.abs(x_xE.astype(jnp.float32))
    s = scale.astype(jnp.float32)[..., None]
    subnormal_abs = 2.0 ** (_MIN_NORMAL_EXP - _MANTISSA_BITS - 1)  # half the 2^-9 spacing
    return _F32_SLACK * jnp.maximum(fp8_relative_error_bound() * x, subnormal_abs * s)
