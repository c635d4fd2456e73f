#!/usr/bin/env bash
# The fast test suite (CPU; kernels in Pallas interpret mode; 8 fake devices for multi-device).
#   bash scripts/test.sh            fast suite
#   bash scripts/test.sh --slow     only the slow-marked tests
#   bash scripts/test.sh -k resume  extra arguments go to pytest
# Tests run in one worker process per core (pytest-xdist; whole files per worker, so a file's
# cached models compile once): test time is mostly single-threaded XLA compilation.
# V41JAX_TEST_WORKERS=1 runs them in one process.
# pytest exits 5 when no test ran; that (like any failure) fails this script and CI.
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
marker="not slow"
if [ "${1:-}" = "--slow" ]; then
  marker="slow"
  shift
fi
exec python -m pytest -m "$marker" -n "${V41JAX_TEST_WORKERS:-auto}" --dist loadfile \
  --durations=10 "$@"
