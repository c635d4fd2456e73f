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

Implementations (``impl``), chosen by the platform the program is LOWERED for
(``platforms.by_platform``), not the default backend at trace time:
  "pallas"     the platform's kernel (``kernel.py``): ``spec_verify_blocked`` on TPU and,
               interpreted, on CPU; ``spec_verify_rowloop`` (Triton) on GPU. ``interpret``
               None (default): interpreted on CPU only; True: the blocked kernel
               interpreted everywhere; False: compiled, and lowering for CPU raises.
  "reference"  ``spec_verify_reference`` (plain jnp).
  "auto"       "reference" on CPU, "pallas" on GPU/TPU (the reference where a given
               ``block_v`` does not fit the platform's kernel).
A ``block_v`` the platform's compiled kernel cannot take (TPU: a multiple of 128 or >= V,
VMEM; GPU: a power of two, Triton's tensor size) raises a ValueError naming the limit when
an impl="pallas" program is lowered for that platform; ``kernel.py``'s functions raise it
at the call.
No gradient: the outputs are integers. Out of contract: verify_len > K acts as K in the
kernels (the reference agrees except with one-hot drafts when all K are accepted, where it
subtracts a one-hot of d_{K-1} from p_K); draft ids outside [0, V) give p_j(d_j) = 0 in the
kernels (the reference reads a fill value).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from v41jax.kernels.platforms import by_platform, unsupported
from v41jax.kernels.spec_verify import kernel as _kernel
from v41jax.kernels.spec_verify.limits import check_block_v
from v41jax.kernels.spec_verify.reference import spec_verify_reference

IMPLS = ("auto", "pallas", "reference")

# Vocabulary columns per block. A multiple of 128 (TPU lanes) and a power of two (Triton):
# p and q blocks of (2K+1) x 1024 f32 are ~70 KiB at K=8, far under VMEM even
# double-buffered, and a 128k vocabulary takes 128 grid steps (each with a small fixed
# per-step overhead; not measured here: no accelerator has run the kernel).
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


def _choose(platform: str, impl: str, interpret, block_v, vocab, k, itemsize, has_q) -> tuple:
    """(kind, interpret, block_v or error message) of one platform's branch; kind is
    "reference", "blocked", "rowloop" or "error"."""
    if impl == "reference" or (impl == "auto" and platform == "cpu"):
        return "reference", False, 0
    bv = DEFAULT_BLOCK_V if block_v is None else block_v
    if interpret or (interpret is None and platform == "cpu"):
        return "blocked", True, min(bv, vocab)
    if platform == "cpu":
        return "error", False, "impl='pallas' on CPU needs interpret=True (or interpret=None)"
    kind = "rowloop" if platform == "cuda" else "blocked"
    try:
        return kind, False, check_block_v(kind, bv, vocab, max(k, 1), itemsize, has_q and k > 0)
    except ValueError as err:
        if impl == "auto":
            return "reference", False, 0
        why = str(err).removeprefix("spec_verify: ")
        return "error", False, f"{why} (this program is lowered for {platform!r})"


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

    ``interpret`` (Pallas only): None = interpreted when lowered for CPU, compiled on
    GPU/TPU; ``block_v`` is the vocabulary block of the kernel (``DEFAULT_BLOCK_V``).
    """
    arrays = [draft_tokens, target_probs, verify_len, accept_u, race_u]
    draft_tokens, target_probs, verify_len, accept_u, race_u = map(jnp.asarray, arrays)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    b, k, v = _validate(draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u)
    _need(impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    _need(
        block_v is None or (isinstance(block_v, int) and block_v >= 1),
        f"block_v must be a positive int, got {block_v!r}",
    )
    args = (draft_tokens, draft_probs, target_probs, verify_len, accept_u, race_u)
    if impl == "reference":
        return spec_verify_reference(*args)
    if b == 0:
        return jnp.zeros((0, k + 1), jnp.int32), jnp.zeros((0,), jnp.int32)
    itemsize = max(target_probs.dtype.itemsize, race_u.dtype.itemsize)
    outs = [jax.ShapeDtypeStruct((b, k + 1), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)]

    def branch(platform):
        kind, interp, bv = _choose(
            platform, impl, interpret, block_v, v, k, itemsize, draft_probs is not None
        )
        if kind == "reference":
            return spec_verify_reference
        if kind == "error":
            return lambda *a: tuple(unsupported(f"spec_verify: {bv}", outs))
        fn = _kernel.spec_verify_rowloop if kind == "rowloop" else _kernel.spec_verify_blocked
        return functools.partial(_run_kernel, fn, vocab_size=v, block_v=bv, interpret=interp)

    return by_platform(args, **{p: branch(p) for p in ("cpu", "cuda", "tpu")})


def _run_kernel(fn, *args, vocab_size, block_v, interpret):
    """``fn`` on the arguments; K = 0 (no drafts) becomes one never-verified draft (L = 0),
    whose column is dropped: the kernels need K >= 1, A = 0 and the token is the p_0 race."""
    d, q, p, verify_len, accept_u, race_u = args
    b, k = d.shape
    if k == 0:
        out, num = fn(
            jnp.zeros((b, 1), jnp.int32),
            None,
            jnp.concatenate([p, jnp.zeros_like(p)], axis=1),  # rare, so the copy is fine
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b, 1), jnp.float32),
            race_u,
            vocab_size=vocab_size,
            block_v=block_v,
            interpret=interpret,
        )
        return out[:, :1], num
    return fn(*args, vocab_size=vocab_size, block_v=block_v, interpret=interpret)
