"""Test-wide set-up: which files this process collects, the `mode` of the
tests every backend runs, and TensorFlow's devices.

Tests are laid out by feature, one folder each (`helpers/` is what all of
them share; `integrations/` runs in its own environment). A test file's name
says where it runs: `test_x.py` on every Keras 3 backend, `test_x_tensorflow.py`,
`test_x_jax.py` or `test_x_torch.py` on that backend only and
`test_x_tf_keras.py` under tf_keras only (`tests.helpers.collection`), so a
file for another backend is never imported.

`mode` ("masked" or "skip") changes what runs on TensorFlow only: a test of
a file that runs on every backend and takes the `mode` fixture runs in both
modes there, and in the default mode on JAX and PyTorch, where the mode
changes nothing. On JAX and PyTorch TensorFlow is not installed and its
devices are not set up.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

    # Two logical CPUs, so MirroredStrategy with two replicas runs
    # in-process. Single-device tests are unaffected: they run on /cpu:0.
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )

# After TensorFlow's set-up: importing the helpers imports Keras.
from tests.helpers import BACKEND, MODES  # noqa: E402
from tests.helpers.collection import pytest_ignore_collect, runs_on  # noqa: E402, F401  (the hook)


def pytest_generate_tests(metafunc):
    every_backend = runs_on(Path(metafunc.module.__file__).name) is None
    if "mode" in metafunc.fixturenames and every_backend and BACKEND == "tensorflow":
        metafunc.parametrize("mode", MODES)


@pytest.fixture
def mode():
    return "masked"
