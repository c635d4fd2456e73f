"""Experiments each have a config.py and a report.py: two experiments' run.py imported in one
process (as the test suite does) must each get their own, not the first one's."""

import importlib.util
import os

import pytest

from v41jax.sweep import experiment_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = ["engram_optim", "engram_scale", "dspark", "dspark_deep", "spec_throughput"]


def _load_run(experiment):
    path = os.path.join(ROOT, "experiments", experiment, "run.py")
    spec = importlib.util.spec_from_file_location(f"test_{experiment}_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_experiment_gets_its_own_config_when_several_load_in_one_process():
    runs = {e: _load_run(e) for e in EXPERIMENTS}
    for experiment, run in runs.items():
        here = os.path.join(ROOT, "experiments", experiment)
        assert os.path.dirname(os.path.abspath(run.C.__file__)) == here, experiment
    # the pair that failed CI: engram_scale's run.py was handed engram_optim's config
    assert hasattr(runs["engram_scale"].C, "cells") and not hasattr(
        runs["engram_scale"].C, "first_stage"
    )
    assert hasattr(runs["engram_optim"].C, "first_stage") and not hasattr(
        runs["engram_optim"].C, "cells"
    )


def test_a_module_loads_once_and_a_missing_one_is_named(tmp_path):
    d = tmp_path / "my_exp"
    d.mkdir()
    (d / "config.py").write_text("VALUE = [1]\n")
    a = experiment_module(str(d), "config")
    assert a is experiment_module(str(d), "config") and a.VALUE == [1]
    assert a.__name__ == "my_exp_config"
    with pytest.raises(FileNotFoundError, match="report.py"):
        experiment_module(str(d), "report")
