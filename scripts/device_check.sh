#!/usr/bin/env bash
# The accelerator check, one command on a GPU/TPU machine: the compiled kernel tests, a short
# training run and quick kernel benchmarks, each under its own timeout (under 10 minutes in
# all), with ONE JSON report. Without a GPU/TPU it prints the plan and exits 0.
#   bash scripts/device_check.sh                  report: $OUT/device_check.json or ./device_check.json
#   bash scripts/device_check.sh --out r.json --stages kernel_tests,train
#   bash scripts/device_check.sh --dry-run        the plan only
# Which Python: $V41JAX_PYTHON if set; else the active virtualenv's; else the first of
# .venv/bin/python, python3 and python whose JAX sees a GPU/TPU (a preinstalled JAX is fine); else
# python3, which then prints the plan. Nothing is downloaded: packages that Python lacks are
# installed from wheels carried in .whl/ (docs/accelerators.md). Options: --help.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# True when `$1`'s JAX has a GPU/TPU backend (JAX_PLATFORMS as the caller set it).
has_accelerator() {
  local code='import sys, jax; sys.exit(jax.default_backend() not in ("gpu", "tpu"))'
  if command -v timeout >/dev/null; then
    timeout 180 "$1" -c "$code" >/dev/null 2>&1
  else
    "$1" -c "$code" >/dev/null 2>&1
  fi
}

py=""
why=""
if [ -n "${V41JAX_PYTHON:-}" ]; then
  py="$V41JAX_PYTHON"
  why="V41JAX_PYTHON is set"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  py="$VIRTUAL_ENV/bin/python"
  why="the active virtualenv $VIRTUAL_ENV"
else
  for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)" \
    "$(command -v python || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ] && has_accelerator "$cand"; then
      py="$cand"
      why="its JAX sees a GPU/TPU"
      break
    fi
  done
  if [ -z "$py" ]; then
    py="$(command -v python3 || true)"
    why="no Python found here has a JAX that sees a GPU/TPU"
  fi
fi
if [ -z "$py" ] || ! command -v "$py" >/dev/null; then
  echo "device_check: no usable python (got '${py}'); set V41JAX_PYTHON=/path/to/python3" >&2
  exit 2
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "device_check: $py is Python $("$py" -V 2>&1); v41jax needs >= 3.11" >&2
  exit 2
fi
# v41jax from this checkout, whether or not it is installed in that Python.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "$ROOT/scripts/device_check.py" --python-reason "$why" "$@"
