"""Entry point of speculative verification: validation and implementation dispatch.

``spec_verify(draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u)``
returns ``(out_tokens int32 [B, K+1], num_accepted int32 [B])`` as defined in
``reference.py``: accept d_j iff j < L and u_j q_j(d_j) < p_j(d_j); A = leading
acceptances; the token after them is the exponential-race winner argmin_v E_v / r_v of the
residual r = max(0, p_A - q_A) (first rejection, A < L; p_A if that residual has no mass) or
of r = p_A (all L verified drafts accepted: the bonus token).

Shapes: draft_tokens int [B, K]; draft_probs float [B, K, V] or None (one-hot drafts);
target_probs float [B, K+1, V]; verify_len int [B] with values in [0, K]; accept_u float
[B, K] and race_u float [B, V], uniforms in [0, 1). Draft ids must lie in [0, V).

Implementations (``impl``):
  "pallas"     the backend's kernel (``kernel.py``): ``spec_verify_blocked`` on TPU and,
               with ``interpret=True``, on CPU; ``spec_verify_rowloop`` (Triton) on GPU.
  "reference"  ``spec_verify_reference`` (plain jnp).
  "auto"       "reference" on CPU, "pallas" on GPU/TPU.
No gradient: the outputs are integers. Out of contract: verify_len > K acts as K in the
kernels (the reference agrees except with one-hot drafts when all K are accepted, where it
subtracts a one-hot of d_{K-1} from p_K); draft ids outside [0, V) give p_j(d_j) = 0 in the
kernels (the reference reads a fill value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41jax.kernels.spec_verify import kernel as _kernel
from v41jax.kernels.spec_verify.reference import spec_verify_reference

IMPLS = ("auto", "pallas", "reference")

# Vocabulary columns per block. A multiple of 128 (TPU lanes) and a power of two (Triton):
# p and q blocks of (2K+1) x 1024 f32 are ~70 KiB at K=8, far under VMEM even
# double-buffered, and a 128k vocabulary takes 128 grid steps (~0.35 us overhead each).
DEFAULT_BLOCK_V = 1024


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(f"spec_verify: {msg}")


def _validate(draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u):
    """Static checks of shapes and dtypes; returns (B, K, V)."""
    is_int = lambda a: jnp.issubdtype(a.dtype, jnp.integer)
    is_float = lambda a: jnp.issubdtype(a.dtype, jnp.floating)
    _need(
        draft_tokens.ndim == 2 and is_int(draft_tokens),
        f"draft_tokens must be int [B, K], got {draft_tokens.dtype}{list(draft_tokens.shape)}",
    )
    b, k = draft_tokens.shape
    _need(
        target_probs.ndim == 3 and target_probs.shape[:2] == (b, k + 1),
        f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V] for draft_tokens [{b}, {k}], "
        f"got {list(target_probs.shape)}",
    )
    v = target_probs.shape[2]
    _need(v >= 1, f"target_probs must have a vocabulary of at least 1, got V = {v}")
    _need(is_float(target_probs), f"target_probs must be floating, got {target_probs.dtype}")
    if draft_probs is not None:
        _need(
            draft_probs.shape == (b, k, v),
            f"draft_probs must be None or [B, K, V] = {[b, k, v]}, got {list(draft_probs.shape)}",
        )
        _need(is_float(draft_probs), f"draft_probs must be floating, got {draft_probs.dtype}")
    for name, arr, want, kind in [
        ("verify_len", verify_len, (b,), "int"),
        ("accept_u", accept_u, (b, k), "float"),
        ("race_u", race_u, (b, v), "float"),
    ]:
        _need(arr.shape == want, f"{name} must have shape {list(want)}, got {list(arr.shape)}")
        ok = is_int(arr) if kind == "int" else is_float(arr)
        _need(ok, f"{name} must be {kind}, got {arr.dtype}")
    return b, k, v


def _block_v(block_v, vocab: int, triton: bool, compiled_tpu: bool) -> int:
    """The vocabulary block of one call (validated)."""
    _need(
        block_v is None or (isinstance(block_v, int) and block_v >= 1),
        f"block_v must be a positive int, got {block_v!r}",
    )
    bv = DEFAULT_BLOCK_V if block_v is None else block_v
    if triton:
        _need(bv & (bv - 1) == 0, f"block_v must be a power of two on GPU, got {bv}")
        # No point loading more than the next power of two above V.
        return min(bv, 1 << (vocab - 1).bit_length())
    if compiled_tpu:
        _need(bv % 128 == 0 or bv >= vocab, f"block_v must be a multiple of 128 on TPU, got {bv}")
    return min(bv, vocab)


def spec_verify(
    draft_tokens,
    draft_probs,
    target_probs,
    verify_len,
    accept_u,
    race_u,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    block_v: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out_tokens int32 [B, K+1], num_accepted int32 [B]); see the module docstring.

    ``interpret`` (Pallas only) defaults to True on CPU; ``block_v`` is the vocabulary
    block of the kernel (default ``DEFAULT_BLOCK_V``).
    """
    arrays = [draft_tokens, target_probs, verify_len, accept_u, race_u]
    draft_tokens, target_probs, verify_len, accept_u, race_u = map(jnp.asarray, arrays)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    b, k, v = _validate(draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u)
    _need(impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if interpret is None:
        interpret = backend == "cpu"
    if impl == "auto":
        impl = "reference" if backend == "cpu" else "pallas"
    args = (draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u)
    if impl == "reference":
        return spec_verify_reference(*args)
    _need(interpret or backend != "cpu", "impl='pallas' on CPU needs interpret=True")
    triton = backend in ("gpu", "cuda", "rocm") and not interpret
    bv = _block_v(block_v, v, triton, compiled_tpu=backend == "tpu" and not interpret)
    if b == 0:
        return jnp.zeros((0, k + 1), jnp.int32), jnp.zeros((0,), jnp.int32)
    if k == 0:
        # No drafts: A = 0 and the token is the p_0 race. The kernels need K >= 1, so add
        # one never-verified draft (L = 0) and drop its column; rare, so the copy is fine.
        out, num = spec_verify(
            jnp.zeros((b, 1), jnp.int32),
            None,
            jnp.concatenate([target_probs, jnp.zeros_like(target_probs)], axis=1),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b, 1), jnp.float32),
            race_u,
            impl="pallas",
            interpret=interpret,
            block_v=block_v,
        )
        return out[:, :1], num
    fn = _kernel.spec_verify_rowloop if triton else _kernel.spec_verify_blocked
    return fn(*args, vocab_size=v, block_v=bv, interpret=bool(interpret))
