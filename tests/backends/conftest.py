"""The tests of what every backend offers, run once per backend environment
(`keras3` on TensorFlow, `keras3-jax`, `keras3-torch`).

`mode` ("masked" or "skip") changes what runs on TensorFlow only: a test
that takes the `mode` fixture runs in both modes there, and in the default
mode on JAX and PyTorch, where the mode changes nothing.
"""

import pytest

from tests.helpers import BACKEND, MODES


def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames and BACKEND == "tensorflow":
        metafunc.parametrize("mode", MODES)


@pytest.fixture
def mode():
    return "masked"
