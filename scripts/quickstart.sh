#!/usr/bin/env bash
# The main job on the bundled corpus: train the `small` model for a few minutes on CPU,
# checkpoint it, evaluate validation loss, and print generated samples.
#   bash scripts/quickstart.sh                       (workdir runs/quickstart)
#   WORKDIR=runs/q2 bash scripts/quickstart.sh --set train.steps=200
# Running it again in the same workdir resumes (or, when finished, just evaluates).
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
WORKDIR="${WORKDIR:-runs/quickstart}"
start=$(date +%s)
python -m v41jax train --config small --workdir "$WORKDIR" "$@"
python -m v41jax generate --workdir "$WORKDIR" --max-new-tokens 60 \
  --prompt "The state of the Union is" \
  --prompt "Our economy" \
  --prompt "I ask the Congress to"
echo "quickstart finished in $(( $(date +%s) - start )) s; run directory: $WORKDIR"
