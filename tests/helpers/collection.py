"""Which process collects a test file: its name says on which backends it runs.

`test_x.py` runs on every Keras 3 backend (TensorFlow, JAX, PyTorch);
`test_x_tensorflow.py` on Keras 3 with TensorFlow only, `test_x_jax.py` on
JAX only, `test_x_torch.py` on PyTorch only, and `test_x_tf_keras.py` under
legacy Keras only (`TF_USE_LEGACY_KERAS=1`), which runs nothing else. A file
for another backend is never imported: TensorFlow is not installed beside
JAX and PyTorch, and it fixes its Keras flavour when it is imported.

`tests/conftest.py` and `property_tests/conftest.py` use this module's
`pytest_ignore_collect` as their hook.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.legacy import LEGACY

# The suffixes of the files that run on one backend only.
ONLY = ("tf_keras", "tensorflow", "jax", "torch")


def active() -> str:
    """The backend this process runs: `"tf_keras"` under legacy Keras, else
    Keras 3's (`KERAS_BACKEND`, TensorFlow by default)."""
    if LEGACY:
        return "tf_keras"
    return os.environ.get("KERAS_BACKEND", "tensorflow")


def runs_on(name: str) -> tuple[str, ...] | None:
    """The backends the test file `name` runs on: one for a backend's
    suffix, `None` (every Keras 3 backend) without one.

    Raises:
        ValueError: if `name` is not a test file's name (`test_*.py`).
    """
    if not (name.startswith("test_") and name.endswith(".py")):
        raise ValueError(f"`name` must be a test file's name (test_*.py), got {name!r}")
    stem = name[: -len(".py")]
    for backend in ONLY:
        if stem.endswith("_" + backend):
            return (backend,)
    return None


def runs_here(name: str, backend: str) -> bool:
    """Whether the test file `name` runs on `backend` (see `active`)."""
    only = runs_on(name)
    if only is None:
        return backend != "tf_keras"
    return backend in only


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Leaves out the test files of the backends this process does not run."""
    name = collection_path.name
    if collection_path.is_dir() or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return None if runs_here(name, active()) else True
