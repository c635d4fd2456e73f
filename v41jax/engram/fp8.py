"""FP8 Engram tables: float8_e4m3fn storage with one float32 scale per row, or (V4.1's own
format, ``quantize_blocks`` and below) one power-of-two UE8M0 scale per block of 32 values.

Both formats side by side, with their bytes per row: docs/engram.md.

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

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_NUMPY = np.dtype(ml_dtypes.float8_e4m3fn)  # the same format on the host
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


# --- V4.1's block format: e4m3fn values, one UE8M0 (power-of-two) scale per block -----------
#
# Layout of the V4.1-Flash checkpoint's Engram rows: a row of E values is E // 32 blocks of 32
# consecutive values; block j of row r is ``q[r, 32j : 32j + 32].astype(f32) * s[r, j]`` with
# ``s = 2^(e - 127)`` and ``e = scale_exp[r, j]`` an unsigned 8-bit exponent (UE8M0, bias 127).
#
# Quantisation, per block with ``m = max|block|``: ``e`` is the smallest exponent with
# ``m / 2^(e - 127) <= 448`` (no clipping; ``m / s`` in (224, 448] unless clamped), computed exactly
# from the bits of ``m``; then ``q = RN_e4m3(x / s)``. Defined corners:
#   * ``m < 2^-126`` (an all-zero block, or only float32-subnormal values): ``e = 127``
#     (``s = 1``, as an all-zero row's scale), and the block comes back exactly zero.
#   * ``e >= 11`` always (``s >= 2^-116``): every nonzero ``q * s`` is a normal float32, so
#     scaling is exact and cannot be flushed to zero on devices that flush subnormals; blocks
#     with ``m <= 448 * 2^-117`` use ``e = 11`` (still no clipping).
#   * So the quantiser writes ``e`` in [11, 247]. In dequantisation ``e = 0`` (``2^-127`` is no
#     normal float32) gives zeros and ``e = 255`` (UE8M0's NaN) gives NaN; ``e`` in [1, 10]
#     may make subnormal products, which a device may flush (the host does not).
#   * ``x_hat`` overflows to inf only where RN_e4m3 rounds up to 2^128: ``|x| >= 2^128 31/32``
#     (~3.30e38, the top 3% of float32's range); the error bound holds below that.
#   * Non-finite input: ``quantize_blocks_np`` and ``export_fp8_blocks`` raise ValueError, and
#     so does ``quantize_blocks`` on concrete arrays; under jit (no check possible) a block
#     holding a NaN or inf gets ``e = 255`` and NaN values, so it dequantises to all-NaN.
#
# Host (numpy + ml_dtypes) and device (jax.numpy) run the same integer/bit arithmetic and one
# float rounding (the e4m3 cast), so they agree bit for bit. Bytes per row: E + E / 32
# (264 for E = 256) against E + 4 for the per-row float32 scale (260).

FP8_BLOCK = 32
UE8M0_BIAS = 127
_ZERO_BLOCK_EXP = 127  # blocks with max|x| < 2^-126 (no normal float32): scale 1
_MIN_BLOCK_EXP = 11  # scale >= 2^-116: every nonzero q * s (|q| >= 2^-9) is >= 2^-125
_NAN_BLOCK_EXP = 255  # UE8M0's NaN: a block with a non-finite element (traced quantisation)
_F32_BITS = 23  # float32 mantissa bits; the exponent field is bits 23..30


def _check_blocks(fn: str, emb: int, block: int) -> int:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")
    if emb % block:
        raise ValueError(f"{fn}: row width E={emb} is not divisible by block={block}")
    return emb // block


def _bitcast(x, dtype, xp):
    if xp is np:
        return np.asarray(x).view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def _pow2(biased_exp, xp):
    """uint/int exponents in [0, 255] -> float32 ``2^(e - 127)`` built from bits (exact;
    ``e = 0`` gives 0.0 and ``e = 255`` gives inf)."""
    return _bitcast(biased_exp.astype(xp.uint32) << _F32_BITS, xp.float32, xp)


def _block_exponents(amax, xp):
    """float32 block maxima (>= 0) -> biased exponents (see the block format notes)."""
    bits = _bitcast(amax.astype(xp.float32), xp.uint32, xp)
    field = ((bits >> _F32_BITS) & 0xFF).astype(xp.int32)  # m = (1 + f) 2^(field - 127)
    # m / 2^(field - 135) = (1 + f) * 256 is in [256, 512); over 448 iff f > 0.75, i.e. the
    # mantissa bits exceed 0b11 followed by 21 zeros: then one more power of two.
    over = ((bits & 0x7FFFFF) > 0x600000).astype(xp.int32)
    exp = xp.maximum(field - 8 + over, _MIN_BLOCK_EXP)
    exp = xp.where(field == 0, _ZERO_BLOCK_EXP, exp)
    return xp.where(field == 0xFF, _NAN_BLOCK_EXP, exp).astype(xp.uint8)


def _quantize_blocks(rows_xE, block, xp, fp8_dtype):
    x = rows_xE.astype(xp.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    exp = _block_exponents(xp.max(xp.abs(xb), axis=-1), xp)
    # 1 / s = 2^(127 - (e - 127)); the clip only keeps the bits sane for e = 255 blocks.
    inv_scale = _pow2(2 * UE8M0_BIAS - xp.clip(exp, _MIN_BLOCK_EXP, 2 * UE8M0_BIAS - 7), xp)
    y = xb * inv_scale[..., None]  # exact: a power of two, result normal or below e4m3's grid
    y = xp.where((exp == _NAN_BLOCK_EXP)[..., None], xp.float32(np.nan), y)
    return y.astype(fp8_dtype).reshape(x.shape), exp


def _dequantize_block_rows(q_xE, exp_xB, xp):
    nb, emb = exp_xB.shape[-1], q_xE.shape[-1]
    if exp_xB.shape[:-1] != q_xE.shape[:-1] or (emb % nb if nb else emb):
        raise ValueError(
            f"dequantize_block_rows: scale_exp shape {exp_xB.shape} does not match q shape "
            f"{q_xE.shape} (want [..., E // block] for a block dividing E)"
        )
    qb = q_xE.astype(xp.float32).reshape(*exp_xB.shape, emb // nb if nb else 0)
    return (qb * _pow2(exp_xB, xp)[..., None]).reshape(q_xE.shape)


def _check_table(fn: str, table, block: int) -> None:
    if table.ndim != 2:
        raise ValueError(f"{fn}: table must be 2-D [R, E], got shape {table.shape}")
    _check_blocks(fn, table.shape[1], block)


def _raise_non_finite(fn: str, table) -> None:
    bad = np.argwhere(~np.isfinite(np.asarray(table, np.float32)))
    raise ValueError(
        f"{fn}: table has {len(bad)} non-finite value(s), first at [row, col] {bad[0].tolist()}"
    )


def quantize_blocks(table_RxE: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """``[R, E]`` float table -> (``[R, E]`` float8_e4m3fn, ``[R, E // block]`` uint8 UE8M0).

    jax.numpy (jit-able); bitwise equal to ``quantize_blocks_np``. Raises ValueError for E not
    divisible by ``block`` and, on concrete input, for non-finite values (traced: NaN blocks).
    """
    _check_table("quantize_blocks", table_RxE, block)
    if not isinstance(table_RxE, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(table_RxE))):
        _raise_non_finite("quantize_blocks", table_RxE)
    return _quantize_blocks(jnp.asarray(table_RxE), block, jnp, FP8_DTYPE)


def quantize_blocks_np(table_RxE: np.ndarray, block: int = FP8_BLOCK):
    """Host form of ``quantize_blocks``: numpy in, (ml_dtypes fp8, uint8) numpy out."""
    table = np.asarray(table_RxE)
    _check_table("quantize_blocks_np", table, block)
    if not np.all(np.isfinite(table)):
        _raise_non_finite("quantize_blocks_np", table)
    return _quantize_blocks(table, block, np, FP8_NUMPY)


def block_scales(scale_exp: jax.Array) -> jax.Array:
    """UE8M0 exponents -> float32 scales ``2^(e - 127)`` (exact; jit-able)."""
    return _pow2(jnp.asarray(scale_exp), jnp)


def block_scales_np(scale_exp: np.ndarray) -> np.ndarray:
    """Host form of ``block_scales`` (bitwise equal)."""
    return _pow2(np.asarray(scale_exp), np)


def dequantize_block_rows(q_rows_xE: jax.Array, exp_rows_xB: jax.Array) -> jax.Array:
    """Gathered rows ``[..., E]`` fp8 + their exponents ``[..., E // block]`` -> float32.

    Row by row, so it commutes with gathering (bitwise)::

        dequantize_block_rows(q[ids], scale_exp[ids]) == dequantize_blocks(q, scale_exp)[ids]

    The block width is ``E // exp_rows.shape[-1]``. jax.numpy, usable inside jit.
    """
    return _dequantize_block_rows(jnp.asarray(q_rows_xE), jnp.asarray(exp_rows_xB), jnp)


def dequantize_block_rows_np(q_rows_xE: np.ndarray, exp_rows_xB: np.ndarray) -> np.ndarray:
    """Host form of ``dequantize_block_rows`` (numpy; bitwise equal to it)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf as on device (see notes)
        return _dequantize_block_rows(np.asarray(q_rows_xE), np.asarray(exp_rows_xB), np)


def dequantize_blocks(q_RxE: jax.Array, scale_exp: jax.Array, block: int = FP8_BLOCK) -> jax.Array:
    """``[R, E]`` fp8 + ``[R, E // block]`` uint8 exponents -> ``[R, E]`` float32."""
    _check_table("dequantize_blocks", q_RxE, block)
    if scale_exp.shape != (q_RxE.shape[0], q_RxE.shape[1] // block):
        raise ValueError(
            f"dequantize_blocks: scale_exp shape {scale_exp.shape} != "
            f"({q_RxE.shape[0]}, {q_RxE.shape[1] // block}) for block={block}"
        )
    return dequantize_block_rows(q_RxE, scale_exp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quantize_blocks(rows_xE: jax.Array, block: int = FP8_BLOCK) -> jax.Array:
    """Quantise-dequantise rows ``[..., E]`` block by block; float32 out (training forward).

    Forward equals ``dequantize_blocks(*quantize_blocks(rows))`` row by row (so gathering
    master rows and fake-quantising them equals gathering the exported table); the gradient
    is the identity (straight-through), as for ``fake_quantize_rows``. Inside jit a block
    holding a non-finite value comes back all-NaN.
    """
    _check_blocks("fake_quantize_blocks", rows_xE.shape[-1], block)
    return _dequantize_block_rows(*_quantize_blocks(rows_xE, block, jnp, FP8_DTYPE), jnp)


def _fake_quantize_blocks_fwd(rows_xE, block):
    return fake_quantize_blocks(rows_xE, block), jnp.zeros((0,), rows_xE.dtype)


def _fake_quantize_blocks_bwd(block, dtype_carrier, g):
    return (g.astype(dtype_carrier.dtype),)


fake_quantize_blocks.defvjp(_fake_quantize_blocks_fwd, _fake_quantize_blocks_bwd)


def export_fp8_blocks(table_RxE, block: int = FP8_BLOCK) -> dict[str, np.ndarray]:
    """Master table (jax or numpy, any float dtype) -> host serving storage
    ``{"q": [R, E] fp8, "scale_exp": [R, E // block] uint8}``, ready for
    ``HostTable(stored["q"], stored["scale_exp"])``. Raises on non-finite values.

    Bytes: E + E / block per row (E + 4 in the per-row format)::

        >>> stored = export_fp8_blocks(np.ones((3, 256), np.float32))
        >>> (stored["q"].nbytes + stored["scale_exp"].nbytes) // 3
        264
        >>> sum(a.nbytes for a in export_fp8(jnp.ones((3, 256))).values()) // 3
        260
    """
    q, scale_exp = quantize_blocks_np(np.asarray(table_RxE).astype(np.float32), block)
    return {"q": q, "scale_exp": scale_exp}


def import_fp8_blocks(stored: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of ``export_fp8_blocks`` up to the FP8 error: ``[R, E]`` float32 (numpy)."""
    return dequantize_block_rows_np(stored["q"], stored["scale_exp"])


def fp8_block_error_bound(x_xE: jax.Array, scale_exp_xB: jax.Array) -> jax.Array:
    """Per-element bound on ``|x_hat - x|`` for rows ``[..., E]`` quantised block-wise with
    exponents ``[..., E // block]`` (``s = 2^(e - 127)`` its block's scale)::

        |x_hat - x| <= max(2^-4 |x|, 2^-10 s)        (no float32 slack needed)

    Derivation: ``s`` is a power of two and every value involved is a normal float32 or
    below e4m3's grid, so ``y = x / s`` and ``x_hat = q * s`` are exact; the only rounding is
    ``q = RN_e4m3(y)``, ``|y| <= 448`` (no clipping). Normal e4m3 (``|y| >= 2^-6``): grid
    spacing ``2^(j-3)`` on ``[2^j, 2^(j+1))``, error ``<= 2^(j-4) <= 2^-4 |y|``, relative
    ``2^-4`` (``fp8_relative_error_bound``). Subnormal (``|y| < 2^-6``, spacing ``2^-9``):
    error ``<= 2^-10``, i.e. ``2^-10 s`` absolute. Multiplying by ``s`` gives the bound. It
    also covers the flushed corners: ``|x| < 2^-126`` (``s >= 2^-116`` makes ``|y| < 2^-10``,
    rounding to 0, error ``|x| < 2^-10 s``). It holds for every finite ``|x| < 2^128 31/32``
    (above, ``x_hat`` rounds up to inf).

    Against the per-row float32 scale (``max|row|`` maps to exactly 448), the power-of-two
    scale maps ``max|block|`` into (224, 448]: up to 1 bit of e4m3's range is wasted, so the
    normal range can start up to 2x higher relative to the block maximum, and the subnormal
    absolute error ``2^-10 s`` can be up to 2x ``2^-10 max|block| / 448``. Per-block scales
    win back far more on heavy-tailed rows: an outlier only coarsens its own 32 values.
    """
    x = jnp.abs(jnp.asarray(x_xE).astype(jnp.float32))
    s = block_scales(scale_exp_xB)
    xb = x.reshape(*s.shape, x.shape[-1] // max(s.shape[-1], 1))
    subnormal_abs = 2.0 ** (_MIN_NORMAL_EXP - _MANTISSA_BITS - 1)
    return jnp.maximum(fp8_relative_error_bound() * xb, subnormal_abs * s[..., None]).reshape(
        x.shape
    )
