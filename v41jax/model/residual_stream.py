"""The residual stream: what the blocks add to, and its three kinds (plain, mHC, mHC single-pass).

The model reads the same in every kind:

    x = stream.expand(Embed(tokens))            # [B, T, D] -> the stream's state
    x = stream.step(x, F, mix, norm)            # around each sub-layer F of each block
    h = stream.read_out(x, final_norm)          # -> the head's normalised input [B, T, D]

Kinds (`residual_stream(cfg)` picks one from `cfg.mhc`):

- `PlainStream` (mHC off): the state is x [B, T, D] and a step is the pre-norm residual
      x_{l+1} = x_l + F(RMSNorm(x_l));          read_out: RMSNorm(x_L)
- `MHCStream` (mHC forms "reference", "fused"): n streams x [B, T, n, C] (C = D),
      x_0 = [e, ..., e] (the embedding copied to each stream, `expand_streams`)
      x_{l+1} = H_res x_l + H_post^T F(RMSNorm(H_pre x_l))   (`v41jax.mhc.MHCResidual`)
      read_out: RMSNorm(sum_i x_L[i])
  H_res [B, T, n, n], H_pre / H_post [B, T, n] come from x_l and the step's mix params.
- `SinglePassStream` (form "single_pass"): the state is a `SinglePassState` (streams, the
  lagged pre-mapping A_{l-1}, the previous sub-layer's pending update); a step runs the one
  pass that finishes sub-layer l-1 and forms F_l's input h_l = RMSNorm(A_{l-1} X_l; g_l)
  (`v41jax.mhc.single_pass`), so the sub-layer's own pre-norm is folded into the pass and
  only its scale g_l remains (`folds_norms`: the norms are `NormScale`s);
      read_out: h_L = RMSNorm(A_{L-1} X_L; g_L) with g_L the final norm's scale.

The mix params (mHC's `MHCResidual` per sub-layer) and the norms stay with the block and the
head that own them (their param names are the checkpoint layout); the stream holds no params
and is a plain value, so it can be rebuilt from the config anywhere (inside `nn.scan` bodies
and `nn.remat` too). The state is a pytree, the scan carry of a scanned run of blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn

from v41jax.config import ModelConfig
from v41jax.mhc import expand_streams, reduce_streams
from v41jax.mhc.layer import (
    SinglePassState,
    single_pass_init,
    single_pass_materialize,
    single_pass_readout,
)

RESIDUAL_AXES = ("batch", "length", "act_embed")
STREAM_AXES = ("batch", "length", "act_streams", "act_embed")  # mHC state [B, T, n, C]

# A sub-layer F: its [B, T, D] input (normalised) -> (output [B, T, D], aux), where aux is
# whatever it hands back beside (the new KV cache, an MoE layer's stats, or None).
Sublayer = Callable[[jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class PlainStream:
    """One residual stream x [B, T, D]: x <- x + F(RMSNorm(x))."""

    folds_norms = False  # the sub-layers' pre-norms are `RMSNorm`s the step applies

    def expand(self, x_BxTxD: jax.Array) -> jax.Array:
        """The state of the embedding: x itself."""
        return x_BxTxD

    def step(
        self, x_BxTxD: jax.Array, sublayer: Sublayer, mix: nn.Module | None, norm: nn.Module
    ) -> tuple[jax.Array, Any, None]:
        """`x + F(norm(x))` -> (new state, F's aux, None: no H_res). `mix` is unused."""
        y, aux = sublayer(norm(x_BxTxD))
        return (
            nn.with_logical_constraint(x_BxTxD + y.astype(x_BxTxD.dtype), RESIDUAL_AXES),
            aux,
            None,
        )

    def apply(self, x_BxTxD: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The state with its array replaced by `fn(array)` (a per-layer memory's update)."""
        return fn(x_BxTxD)

    def hidden(self, x_BxTxD: jax.Array) -> jax.Array:
        """The [B, T, D] hidden state of a block's output (`ModelOutput.hidden`)."""
        return x_BxTxD

    def read_out(self, x_BxTxD: jax.Array, final_norm: nn.Module) -> jax.Array:
        """The head's input `final_norm(x)` [B, T, D]."""
        return final_norm(x_BxTxD)


@dataclasses.dataclass(frozen=True)
class MHCStream:
    """n residual streams x [B, T, n, C]: x <- H_res x + H_post^T F(RMSNorm(H_pre x)),
    with the mix coefficients of the sub-layer's `MHCResidual` (forms "reference", "fused")."""

    n_streams: int
    folds_norms = False

    def expand(self, x_BxTxD: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, n, D]: the embedding copied to each stream."""
        return nn.with_logical_constraint(expand_streams(x_BxTxD, self.n_streams), STREAM_AXES)

    def step(
        self, x_BxTxNxC: jax.Array, sublayer: Sublayer, mix: nn.Module, norm: nn.Module
    ) -> tuple[jax.Array, Any, jax.Array]:
        """`mix(x, F o norm)` -> (new state [B, T, n, C], F's aux, H_res [B, T, n, n])."""
        x_new, aux, h_res_BxTxNxN = mix(x_BxTxNxC, lambda h: sublayer(norm(h)))
        return nn.with_logical_constraint(x_new, STREAM_AXES), aux, h_res_BxTxNxN

    def apply(self, x_BxTxNxC: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The state with its streams replaced by `fn(streams)`."""
        return fn(x_BxTxNxC)

    def hidden(self, x_BxTxNxC: jax.Array) -> jax.Array:
        """The streams summed, [B, T, C]."""
        return reduce_streams(x_BxTxNxC)

    def read_out(self, x_BxTxNxC: jax.Array, final_norm: nn.Module) -> jax.Array:
        """`final_norm(sum_i x[i])` [B, T, C]."""
        return final_norm(reduce_streams(x_BxTxNxC))


@dataclasses.dataclass(frozen=True)
class SinglePassStream:
    """mHC form "single_pass": the state is a `SinglePassState` and each step is one pass that
    applies the previous sub-layer's pending update and forms this one's normalised input
    (module docstring; `v41jax.mhc.layer.MHCResidual`)."""

    n_streams: int
    norm_eps: float
    folds_norms = True  # the sub-layers' norms are `NormScale`s: the pass normalises

    def expand(self, x_BxTxD: jax.Array) -> SinglePassState:
        """X_0 = the embedding on each stream, with the one-hot pre-mapping A_{-1} = e_0."""
        streams = nn.with_logical_constraint(expand_streams(x_BxTxD, self.n_streams), STREAM_AXES)
        return single_pass_init(streams)

    def step(
        self, state: SinglePassState, sublayer: Sublayer, mix: nn.Module, norm: nn.Module
    ) -> tuple[SinglePassState, Any, jax.Array]:
        """`mix(state, F, g)` with g = norm() the sub-layer's input-norm scale [C] ->
        (new state, its update pending; F's aux; H_res [B, T, n, n])."""
        new, aux, h_res_BxTxNxN = mix(state, sublayer, norm())
        new = new._replace(x=nn.with_logical_constraint(new.x, STREAM_AXES))
        return new, aux, h_res_BxTxNxN

    def apply(
        self, state: SinglePassState, fn: Callable[[jax.Array], jax.Array]
    ) -> SinglePassState:
        """The state materialised (pending update applied), its streams replaced by `fn`."""
        state = single_pass_materialize(state)
        return state._replace(x=fn(state.x))

    def hidden(self, state: SinglePassState) -> jax.Array:
        """The materialised streams summed, [B, T, C]."""
        return reduce_streams(single_pass_materialize(state).x)

    def read_out(self, state: SinglePassState, final_norm: nn.Module) -> jax.Array:
        """The last pass: h_L = RMSNorm(A_{L-1} X_L; g) [B, T, C], g = final_norm() (its
        `NormScale`), in the streams' dtype."""
        _, h_BxTxC = single_pass_readout(state, final_norm(), self.norm_eps, state.x.dtype)
        return h_BxTxC


ResidualStream = PlainStream | MHCStream | SinglePassStream


def residual_stream(cfg: ModelConfig) -> ResidualStream:
    """The stream of `cfg`: plain without mHC, else by `cfg.mhc.form`."""
    if not cfg.mhc.enabled:
        return PlainStream()
    if cfg.mhc.form == "single_pass":
        return SinglePassStream(cfg.mhc.n_streams, cfg.norm_eps)
    return MHCStream(cfg.mhc.n_streams)
