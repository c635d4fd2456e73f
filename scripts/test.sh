#!/usr/bin/env bash
# The fast test suite (CPU; kernels in Pallas interpret mode; 8 fake devices for multi-device).
#   bash scripts/test.sh            fast suite, then the compile-for-the-chip tier (tests/aot
#                                   in .venv-aot: scripts/test_aot.sh; V41JAX_TEST_AOT=0 skips it)
#   bash scripts/test.sh --slow     only the slow-marked tests
#   bash scripts/test.sh --smoke    the smoke tier: the files in tests/smoke_files.txt, a few
#                                   minutes; run it before every commit (CI runs the whole suite)
#   bash scripts/test.sh --e2e      only the end-to-end tests (marked e2e: they run
#                                   `python -m v41jax` in a subprocess), slow ones excluded
#   bash scripts/test.sh -k resume  extra arguments go to pytest (the fast suite only)
# Tests run in one worker process per core (pytest-xdist; whole files per worker, so a file's
# cached models compile once): test time is mostly single-threaded XLA compilation.
# V41JAX_TEST_WORKERS=1 runs them in one process.
# The workers and the subprocesses they start share a persistent XLA compilation cache, a
# fresh directory per run (tests/conftest.py); V41JAX_TEST_XLA_CACHE=DIR keeps one across
# runs (later runs skip most compiles), V41JAX_TEST_XLA_CACHE=off turns it off.
# A kernel case marked slow is slow in the Pallas interpreter: its compiled twin stays in
# the fast selection, which is what the device check runs.
# A worker that crashes stops the run (--max-worker-restart=0): pytest-xdist 3.8 can hang
# for ever after replacing a crashed worker under --dist loadfile (pytest-xdist#1378).
# pytest exits 5 when no test ran; that (like any failure) fails this script and CI.
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
marker="not slow"
selection=()
if [ "${1:-}" = "--slow" ]; then
  marker="slow"
  shift
elif [ "${1:-}" = "--e2e" ]; then
  marker="e2e and not slow"
  shift
elif [ "${1:-}" = "--smoke" ]; then
  mapfile -t selection < <(grep -v '^#' tests/smoke_files.txt | grep .)
  shift
fi
run_aot=0
if [ $# -eq 0 ] && [ "$marker" = "not slow" ] && [ ${#selection[@]} -eq 0 ] \
  && [ "${V41JAX_TEST_AOT:-1}" != "0" ]; then
  run_aot=1
fi
python -m pytest -m "$marker" -n "${V41JAX_TEST_WORKERS:-auto}" --dist loadfile \
  --max-worker-restart=0 --durations=10 "${selection[@]}" "$@" || exit $?
if [ "$run_aot" = 1 ]; then
  # its own venv and environment (libtpu, the CUDA plugin); 43 compiles, minutes on 2 cores
  exec bash "$(dirname "${BASH_SOURCE[0]}")/test_aot.sh"
fi
