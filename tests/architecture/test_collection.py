"""The tests' own layout: one folder per feature, and a file's name says on
which backends it runs (`tests.helpers.collection`, `tests/conftest.py`)."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers.collection import active, runs_here

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name, backend, runs",
    [
        ("test_x.py", "tensorflow", True),
        ("test_x.py", "jax", True),
        ("test_x.py", "torch", True),
        ("test_x.py", "tf_keras", False),
        ("test_x_tensorflow.py", "tensorflow", True),
        ("test_x_tensorflow.py", "jax", False),
        ("test_x_tensorflow.py", "tf_keras", False),
        ("test_x_tf_keras.py", "tf_keras", True),
        ("test_x_tf_keras.py", "tensorflow", False),
        ("test_x_jax.py", "jax", True),
        ("test_x_jax.py", "torch", False),
        ("test_x_torch.py", "torch", True),
        ("test_x_torch.py", "tensorflow", False),
    ],
)
def test_a_file_name_says_where_it_runs(name, backend, runs):
    assert runs_here(name, backend) is runs


def test_a_name_that_is_no_test_file_is_refused():
    with pytest.raises(ValueError, match="`name` must be a test file's name"):
        runs_here("helpers.py", "tensorflow")


def test_this_process_collected_only_the_files_of_its_backend(request):
    names = {pathlib.Path(item.fspath).name for item in request.session.items}
    assert names, "nothing collected"
    assert not {n for n in names if not runs_here(n, active())}


def test_every_test_file_is_in_a_feature_folder():
    """Directly under `tests/` or `property_tests/` only shared modules and
    the property tests; no folder is named after an environment."""
    for path in (ROOT / "tests").rglob("test_*.py"):
        folder = path.relative_to(ROOT / "tests").parts[:-1]
        assert len(folder) == 1, path
        assert folder[0] not in ("backends", "tf_keras", "helpers"), path
        assert (path.parent / "__init__.py").exists(), path
    for path in (ROOT / "property_tests").rglob("test_*.py"):
        assert "backends" not in path.parts and "tf_keras" not in path.parts, path
