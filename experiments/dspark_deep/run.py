"""DSpark against a deep target: train the target and the drafters, then measure.

    python experiments/dspark_deep/run.py [--runs-dir runs/dspark_deep] [--stage all|train]

Training is resumable: a finished run is skipped, an interrupted one continues from its last
checkpoint when the same command runs again.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import config as C  # noqa: E402

from v41jax.data.corpus import split_speeches_by_year  # noqa: E402
from v41jax.sweep import experiment_dirs  # noqa: E402
from v41jax.train import train  # noqa: E402


def _finished(result: dict) -> None:
    # A run stopped by a signal has checkpointed; later stages build on it.
    if result.get("stopped"):
        sys.exit("stopped by a signal; rerun the same command to continue")


def train_all(runs_dir: str) -> dict:
    early, _ = split_speeches_by_year(os.path.join(runs_dir, "texts"), C.SPLIT_YEAR)
    w = {"target": os.path.join(runs_dir, "target")}
    _finished(train(C.target_config(early), w["target"]))
    return w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--stage", choices=("all", "train"), default="all")
    args = p.parse_args(argv)
    runs_dir, _ = experiment_dirs(HERE, "full", args.runs_dir)
    train_all(runs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
