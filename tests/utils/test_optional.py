"""Flax only where the program uses it: jaxamp's core runs where Flax cannot be imported."""

import os
import pathlib
import subprocess
import sys

import jaxamp

SCRIPT = pathlib.Path(__file__).with_name("without_flax.py")
ROOT = SCRIPT.parents[2]


def test_import_the_optax_path_step_and_autocast_run_without_flax():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--block"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0 and "without flax: ok" in run.stdout, run.stdout + run.stderr


def test_the_flax_adapters_are_served_on_first_use():
    from flax.training import train_state

    from jaxamp.skip._train_state import TrainState

    assert jaxamp.TrainState is TrainState
    assert issubclass(TrainState, train_state.TrainState)
    assert jaxamp.nnx.Optimizer.__module__ == "jaxamp.skip._nnx"
    assert {"TrainState", "nnx"} <= set(dir(jaxamp))
