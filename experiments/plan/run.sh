#!/usr/bin/env bash
# The planner's runs behind README "Launching on TPU / GPU": each writes <name>.json here and
# prints its table (saved as <name>.txt). Every plan compiles the train step twice: on fake
# CPU devices (the estimate) and for the real chip (--topology: a TPU slice through libtpu;
# --gpu: H100s described by v41jax/kernels/gpu_targets/h100.txtpb through XLA:GPU), so it
# runs in the aot venv (.venv-aot: libtpu and the CUDA PJRT plugin; made here if missing).
# One compile at a time; 1-10 minutes each on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
V41JAX_VENV=.venv-aot V41JAX_EXTRAS=aot source scripts/_setup.sh
export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1
MESH=data=1,fsdp=8,tensor=1
TPU=(--platform tpu --topology v5e:2x4)
CUDA=(--platform cuda --gpu h100)
plan() {  # plan NAME ARGS...
  local name=$1; shift
  python -m v41jax plan --mesh "$MESH" --json "experiments/plan/$name.json" "$@" \
    | tee "experiments/plan/$name.txt"
}
# the default attention ("auto": splash on TPU) and the blockwise XLA path
plan 1b_tpu --config 1b "${TPU[@]}"
plan 1b-engram_tpu --config 1b-engram "${TPU[@]}"
plan 1b-mhc_tpu --config 1b-mhc "${TPU[@]}"
plan 1b_tpu_blockwise --config 1b "${TPU[@]}" --set model.attention_impl=blockwise
plan 8b_cuda --config 8b "${CUDA[@]}"
plan 8b-engram_cuda --config 8b-engram "${CUDA[@]}"
plan 8b-mhc_cuda --config 8b-mhc "${CUDA[@]}"
# without the variants' gradient accumulation (train.microbatches=1)
plan 1b-engram_tpu_nomicro --config 1b-engram "${TPU[@]}" --no-lower --set train.microbatches=1
plan 1b-mhc_tpu_nomicro --config 1b-mhc "${TPU[@]}" --no-lower --set train.microbatches=1
plan 8b-engram_cuda_nomicro --config 8b-engram "${CUDA[@]}" --no-lower --set train.microbatches=1
plan 8b-mhc_cuda_nomicro --config 8b-mhc "${CUDA[@]}" --no-lower --set train.microbatches=1
# layers outside a scan: XLA:CPU's schedule keeps what remat would recompute (full = none)
plan 1b_tpu_unscanned --config 1b "${TPU[@]}" --no-lower --set model.scan_layers=false
plan 1b_tpu_unscanned_noremat --config 1b "${TPU[@]}" --no-lower --set model.scan_layers=false \
  --set model.remat_policy=none
# the full-logits head (model.logits_chunk=0): fp32 [B, T, V] logits and their gradient
plan 1b_tpu_full_logits --config 1b "${TPU[@]}" --no-lower --set model.logits_chunk=0
# the 8b steps on TPU: 8 v5e chips (15.75 GiB each) and 8 v5p chips (95.74 GiB each)
plan 8b_tpu --config 8b --platform tpu --topology v5e:2x4 --no-lower
plan 8b_tpu_v5p --config 8b --platform tpu --topology v5p:2x2x2 --no-lower
