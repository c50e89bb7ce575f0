"""Importing gradaccum on the active backend, and backends that cannot train."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import keras
import pytest

from gradaccum import accumulate
from tests.backends.helpers import BACKEND


@pytest.mark.skipif(BACKEND == "tensorflow", reason="Keras imports TensorFlow on its backend")
def test_import_needs_no_tensorflow():
    code = (
        "import sys, keras, gradaccum, gradaccum.layers, gradaccum.callbacks\n"
        "gradaccum.accumulate(keras.optimizers.Adam(), 2)\n"
        "print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "KERAS_BACKEND": BACKEND},
    )
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("name", ["numpy", "openvino"])
def test_a_backend_that_cannot_train_is_named(monkeypatch, name):
    monkeypatch.setattr(keras.config, "backend", lambda: name)
    with pytest.raises(ValueError, match=f"active Keras backend is '{name}'"):
        accumulate(keras.optimizers.SGD(0.1), 2)


@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="Keras's numpy backend imports JAX (keras3-jax runs this)"
)
def test_numpy_backend_refuses_in_a_fresh_process():
    code = (
        "import keras, gradaccum\n"
        "try:\n"
        "    gradaccum.accumulate(keras.optimizers.SGD(0.1), 2)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "KERAS_BACKEND": "numpy"},
    )
    assert "'numpy'" in out.stdout and "cannot train" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(BACKEND == "tensorflow", reason="the layer runs on TensorFlow (tests/test_batch_norm.py)")
def test_the_batch_normalization_layer_is_refused_by_name():
    from gradaccum.layers import BatchNormalization

    with pytest.raises(ValueError, match=f"TensorFlow backend only.*'{BACKEND}'"):
        BatchNormalization()
