"""mHC around your own sub-layer, data-parallel under `jax.shard_map`.

mHC (manifold-constrained hyper-connections) replaces the residual stream by n streams
x [B, T, n, C] and wraps every sub-layer F as

    x <- H_res x + H_post^T F(H_pre x)

with per-token coefficients from `mhc_coefficients` (H_res doubly stochastic, by Sinkhorn-
Knopp). The pieces are pure functions of explicit params, so F can be anything mapping
[B, T, C] -> [B, T, C]: here the user's own small MLP. The whole model (expand the embedding
into n streams, a few mHC-wrapped MLP layers, sum the streams back) runs per shard under
`jax.shard_map` over a 1-D mesh of all devices, the batch split over them and the params
replicated. mHC is per token, so the sharded result equals the unsharded one.

Run: python examples/mhc_shard_map.py
(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 gives it 8 devices to shard over)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from v41jax import (
    MHCConfig,
    expand_streams,
    mhc_apply,
    mhc_coefficients,
    mhc_params_init,
    reduce_streams,
)

N_STREAMS = 4
WIDTH = 8
HIDDEN = 32
LAYERS = 2
# H_res starts near the identity (diagonal 0.99), where Sinkhorn-Knopp converges slowly: the
# "paper" variant ends on a row normalisation, so rows sum to 1 exactly, and with the default
# 20 iterations the column sums are still ~1e-3 off at alpha = 0.1 (~3e-4 at alpha's default
# 0.01, n = 4). 400 iterations make H_res doubly stochastic to float32 rounding.
CFG = MHCConfig(n_streams=N_STREAMS, sinkhorn_iters=400, alpha_init=0.1)


def init_params(key: jax.Array) -> list[dict]:
    """Per layer: the mHC coefficients' params (`mhc_params_init`) and the user's MLP's."""
    layers = []
    for i in range(LAYERS):
        k_mhc, k1, k2 = jax.random.split(jax.random.fold_in(key, i), 3)
        mhc = mhc_params_init(k_mhc, N_STREAMS, WIDTH, CFG)
        mlp = {
            "w1": jax.random.normal(k1, (WIDTH, HIDDEN), jnp.float32) / np.sqrt(WIDTH),
            "w2": jax.random.normal(k2, (HIDDEN, WIDTH), jnp.float32) / np.sqrt(HIDDEN),
        }
        layers.append({"mhc": mhc, "mlp": mlp})
    return layers


def my_mlp(params: dict, h: jax.Array) -> jax.Array:
    """The user's sub-layer F: pre-norm MLP, [B, T, C] -> [B, T, C]."""
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return jax.nn.gelu(h @ params["w1"]) @ params["w2"]


def model(params: list[dict], h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, C], every layer's mixing matrix H_res [L, B, T, n, n])."""
    x = expand_streams(h, N_STREAMS)  # [B, T, n, C]
    h_res_all = []
    for layer in params:
        coeffs = mhc_coefficients(layer["mhc"], x, CFG)
        x, _ = mhc_apply(x, lambda h_in, mlp=layer["mlp"]: (my_mlp(mlp, h_in), None), coeffs)
        h_res_all.append(coeffs[2])
    return reduce_streams(x), jnp.stack(h_res_all)


def sharded_model(mesh: Mesh):
    """`model` under shard_map: params replicated (P()), batch split over "data"."""
    return jax.jit(
        jax.shard_map(
            model,
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=(P("data"), P(None, "data")),
        )
    )


def main(rows_per_device: int = 2, length: int = 5, seed: int = 0) -> dict:
    """Returns the mesh size, the input, the sharded and unsharded outputs and H_res."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    k_params, k_h = jax.random.split(jax.random.key(seed))
    params = init_params(k_params)
    h = jax.random.normal(k_h, (rows_per_device * devices.size, length, WIDTH), jnp.float32)
    h_sharded = jax.device_put(h, NamedSharding(mesh, P("data")))
    out, h_res = sharded_model(mesh)(params, h_sharded)
    out_ref, h_res_ref = jax.jit(model)(params, h)
    return dict(
        num_devices=int(devices.size),
        h=h,
        out=out,
        out_sharding=out.sharding,
        out_unsharded=out_ref,
        h_res=h_res,
        h_res_unsharded=h_res_ref,
    )


if __name__ == "__main__":
    r = main()
    err = float(jnp.max(jnp.abs(r["out"] - r["out_unsharded"])))
    rows = np.abs(np.asarray(r["h_res"]).sum(-1) - 1).max()
    cols = np.abs(np.asarray(r["h_res"]).sum(-2) - 1).max()
    print(f"{r['num_devices']} devices, output {r['out'].shape}: sharded vs unsharded "
          f"max |diff| = {err:.2e}")  # fmt: skip
    print(f"H_res row sums off 1 by <= {rows:.1e}, column sums by <= {cols:.1e}")
