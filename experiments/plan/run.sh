#!/usr/bin/env bash
# The planner's runs behind README "Launching on TPU / GPU": each writes <name>.json here and
# prints its table (saved as <name>.txt). One compile at a time; ~1 minute each on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
MESH=data=1,fsdp=8,tensor=1
plan() {  # plan NAME ARGS...
  local name=$1; shift
  python -m v41jax plan --mesh "$MESH" --json "experiments/plan/$name.json" "$@" \
    | tee "experiments/plan/$name.txt"
}
# the default attention ("auto": splash on TPU) and the blockwise XLA path
plan 1b_tpu --config 1b --platform tpu
plan 1b_tpu_blockwise --config 1b --platform tpu --set model.attention_impl=blockwise
plan 1b-engram_tpu_blockwise --config 1b-engram --platform tpu --set model.attention_impl=blockwise
plan 1b-mhc_tpu_blockwise --config 1b-mhc --platform tpu --set model.attention_impl=blockwise
plan 8b_cuda --config 8b --platform cuda
plan 8b-engram_cuda --config 8b-engram --platform cuda
plan 8b-mhc_cuda --config 8b-mhc --platform cuda
# without the variants' gradient accumulation (train.microbatches=1): they do not fit
plan 1b-engram_tpu_nomicro --config 1b-engram --platform tpu --no-lower --set train.microbatches=1
plan 1b-mhc_tpu_nomicro --config 1b-mhc --platform tpu --no-lower --set train.microbatches=1
plan 8b-engram_cuda_nomicro --config 8b-engram --platform cuda --no-lower --set train.microbatches=1
plan 8b-mhc_cuda_nomicro --config 8b-mhc --platform cuda --no-lower --set train.microbatches=1
# layers outside a scan: XLA:CPU's schedule keeps what remat would recompute (full = none)
plan 1b_tpu_unscanned --config 1b --platform tpu --no-lower --set model.scan_layers=false
plan 1b_tpu_unscanned_noremat --config 1b --platform tpu --no-lower --set model.scan_layers=false \
  --set model.remat_policy=none
# the full-logits head (model.logits_chunk=0): fp32 [B, T, V] logits and their gradient
plan 1b_tpu_full_logits --config 1b --platform tpu --no-lower --set model.logits_chunk=0
