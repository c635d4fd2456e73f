"""Sinkhorn's row and column sums at init and after 1,000 training steps, plain vs polished.

    python experiments/mhc_stability/sinkhorn_sums.py [--runs-dir runs] [--steps 1000]

Trains (or resumes) this experiment's `mhc` arm with the Newton-polished Sinkhorn
(`model.mhc.sinkhorn_newton_steps=4`) for --steps steps in <runs-dir>/mhc_sinkhorn_polished,
then, for every sub-layer's mHC params at init (alpha_init 0.01 and 0.1) and at the trained
checkpoint, computes H_res on random unit-variance streams [4, 256, n, C] with the plain 20
iterations and with the polish, and writes the worst |row sum - 1| and |column sum - 1| over
tokens and sub-layers to results/sinkhorn_sums.json (with the trained alpha ranges, the
machine and the commit). `tests/mhc/test_sinkhorn_convergence.py` checks that file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import numpy as np

from v41jax.bench.common import machine_info
from v41jax.config import override
from v41jax.mhc import MHCConfig
from v41jax.mhc.reference import mhc_coefficients, mhc_params_init
from v41jax.sweep import experiment_module, git_commit
from v41jax.train.loop import train
from v41jax.train.runs import load_run

HERE = os.path.dirname(os.path.abspath(__file__))
C = experiment_module(HERE, "config")
RESULTS = os.path.join(HERE, "results", "sinkhorn_sums.json")
STREAMS = (4, 256)  # random streams [4, 256, n, C] per sub-layer


def mhc_param_sets(tree) -> list[dict]:
    """Every sub-layer's mHC params (dicts holding phi, alpha and bias), in tree order;
    scanned layers' stacked params ([layers, ...]) are split into one set per layer."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if {"phi", "alpha", "bias"} <= set(node):
                if node["phi"].ndim == 3:  # stacked by the layer scan
                    found.extend({k: v[i] for k, v in node.items()}
                                 for i in range(node["phi"].shape[0]))  # fmt: skip
                else:
                    found.append(node)
                return
            for key in sorted(node):
                walk(node[key])

    walk(jax.tree.map(np.asarray, tree))
    return found


def worst_sums(param_sets, mhc: MHCConfig, width: int, seed: int = 0) -> dict:
    """max |rowsum - 1| and |colsum - 1| of H_res over tokens and sub-layers, plain and
    polished (the same params and streams)."""
    out = {}
    for name, steps in (("plain_20", 0), ("polished", 4)):
        cfg = dataclasses.replace(mhc, sinkhorn_newton_steps=steps)
        rows = cols = 0.0
        for k, p in enumerate(param_sets):
            x = jax.random.normal(jax.random.PRNGKey(seed + k), (*STREAMS, mhc.n_streams, width))
            h = np.asarray(mhc_coefficients(p, x, cfg)[2], np.float64)
            rows = max(rows, float(np.abs(h.sum(-1) - 1).max()))
            cols = max(cols, float(np.abs(h.sum(-2) - 1).max()))
        out[name] = {"rows": rows, "cols": cols}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args(argv)
    cfg = override(C.get_config("mhc,seed=0"), [
        "model.mhc.sinkhorn_newton_steps=4", f"train.steps={args.steps}",
        f"train.eval_every={args.steps}", f"train.checkpoint_every={max(1, args.steps // 2)}",
    ])  # fmt: skip
    workdir = os.path.join(args.runs_dir, "mhc_sinkhorn_polished")
    train(cfg, workdir)
    run = load_run(workdir)
    mhc, width, n = cfg.model.mhc, cfg.model.d_model, cfg.model.mhc.n_streams
    trained = mhc_param_sets(run.params)
    result = {"trained": {"step": run.step, "sublayers": len(trained),
                          **worst_sums(trained, mhc, width)}}  # fmt: skip
    alphas = np.stack([np.asarray(s["alpha"]) for s in trained])
    result["trained"]["alpha_min"] = alphas.min(0).tolist()
    result["trained"]["alpha_max"] = alphas.max(0).tolist()
    for alpha in (0.01, 0.1):
        init_cfg = dataclasses.replace(mhc, alpha_init=alpha)
        keys = jax.random.split(jax.random.PRNGKey(1), len(trained))
        sets = [mhc_params_init(k, n, width, init_cfg) for k in keys]
        result[f"init_alpha_{alpha}"] = {"sublayers": len(sets), **worst_sums(sets, mhc, width)}
    result |= {"streams": list(STREAMS), "machine": machine_info(), "commit": git_commit(HERE)}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
