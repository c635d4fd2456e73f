#!/usr/bin/env bash
# The ahead-of-time compile tier: every kernel and step compiled for TPU and GPU on this
# machine, which has neither (tests/aot; v41jax.kernels.aot).
#   bash scripts/test_aot.sh              the tier
#   bash scripts/test_aot.sh -k engram    extra arguments go to pytest
#   bash scripts/test_aot.sh --setup      only make .venv-aot (for the planner's --topology /
#                                         --gpu and `bench kernel_bytes`, run from it)
# It keeps its own venv, .venv-aot (requirements + corpus + the package with its `aot` extra:
# libtpu and the CUDA PJRT plugin, pinned to the project's JAX), so the main .venv stays as
# CI and the fast suite know it. JAX runs on the CPU (JAX_PLATFORMS=cpu): the TPU compiler
# (libtpu) and the GPU compiler (the CUDA plugin) compile against described devices
# (jax.experimental.topologies) and nothing is executed on them.
# A compile of a kernel's gradient takes 1-2.5 minutes on a loaded 2-core machine.
# pytest exits 5 when no test ran; that (like any failure) fails this script.
V41JAX_VENV=.venv-aot V41JAX_EXTRAS=aot source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
if [[ "${1:-}" == "--setup" ]]; then
  echo "ready: $(python -c 'import sys; print(sys.prefix)')"
  exit 0
fi
exec python -m pytest tests/aot -n "${V41JAX_TEST_WORKERS:-auto}" --dist loadfile \
  --max-worker-restart=0 --durations=10 "$@"
