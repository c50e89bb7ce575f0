"""Importing gradaccum on the active backend, and backends that cannot train."""

from __future__ import annotations

import importlib.util

import keras
import pytest

from gradaccum import accumulate
from tests.helpers import BACKEND
from tests.helpers.processes import run_python


@pytest.mark.skipif(BACKEND == "tensorflow", reason="Keras imports TensorFlow on its backend")
def test_import_needs_no_tensorflow():
    out = run_python(
        """
        import sys, keras, gradaccum, gradaccum.layers, gradaccum.callbacks
        gradaccum.accumulate(keras.optimizers.Adam(), 2)
        print('tensorflow' in sys.modules)
        """,
        env={"KERAS_BACKEND": BACKEND},
    )
    assert out.strip() == "False"


@pytest.mark.parametrize("name", ["numpy", "openvino"])
def test_a_backend_that_cannot_train_is_named(monkeypatch, name):
    """Wrapping fails at once and names the backend, instead of failing
    later inside `build` or `fit`."""
    monkeypatch.setattr(keras.config, "backend", lambda: name)
    with pytest.raises(ValueError, match=f"active Keras backend is '{name}', which cannot train.*KERAS_BACKEND"):
        accumulate(keras.optimizers.SGD(0.1), 2)
    with pytest.raises(ValueError, match=f"'{name}'"):
        accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), 2)


def test_a_refused_backend_leaves_the_patches_to_the_one_that_trains():
    """A first `accumulate` refused under a backend that cannot train
    installs nothing, so that the first one on the real backend installs its
    trainer's patches: a split step then applies once per batch."""
    out = run_python(
        """
        import unittest.mock, numpy as np, keras, gradaccum
        with unittest.mock.patch.object(keras.config, "backend", lambda: "numpy"):
            try:
                gradaccum.accumulate(keras.optimizers.SGD(0.1), 2)
            except ValueError:
                pass
        opt = gradaccum.accumulate(keras.optimizers.SGD(0.1), micro_batch_size=2)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=opt, loss="mse")
        model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        print(int(opt.iterations))
        """,
        env={"KERAS_BACKEND": BACKEND},
    )
    assert out.strip().splitlines()[-1] == "2", out


@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="Keras's numpy backend imports JAX (keras3-jax runs this)"
)
def test_numpy_backend_refuses_in_a_fresh_process():
    out = run_python(
        """
        import keras, gradaccum
        try:
            gradaccum.accumulate(keras.optimizers.SGD(0.1), 2)
        except ValueError as e:
            print(e)
        """,
        env={"KERAS_BACKEND": "numpy"},
    )
    assert "'numpy'" in out and "cannot train" in out, out


@pytest.mark.skipif(BACKEND == "tensorflow", reason="the layer runs on TensorFlow (tests/batch_norm)")
def test_the_batch_normalization_layer_is_refused_by_name():
    from gradaccum.layers import BatchNormalization

    with pytest.raises(ValueError, match=f"TensorFlow backend only.*'{BACKEND}'"):
        BatchNormalization()


def test_only_tensorflow_gives_the_hooks_of_kept_slices():
    """The state keeps a file's slices as slices only where the backend
    declares the hooks of kept slices (TensorFlow, with `tf.IndexedSlices`);
    elsewhere it adds them into rows."""
    from gradaccum._backend import KeptSlices, for_active

    assert isinstance(for_active(), KeptSlices) == (BACKEND == "tensorflow")


def test_the_active_backend_gives_every_declared_hook():
    """`Backend` and its groups are protocols the backends follow by
    duck typing: each hook they declare is there, on every backend."""
    from gradaccum import _backend

    backend = _backend.for_active()
    groups = {"": (_backend.Backend, backend), "tensors": (_backend.Tensors, backend.tensors),
              "replicas": (_backend.Replicas, backend.replicas), "gradients": (_backend.Gradients, backend.gradients)}
    for group, (protocol, hooks) in groups.items():
        declared = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
        assert declared, group
        assert not [name for name in declared if not callable(getattr(hooks, name, None))], group
