"""What the tests of every backend need beyond `tests.support`: gradients
computed the active backend's way, and which ways of running `fit` it has.

These tests run on every Keras backend: in the `keras3-jax` and
`keras3-torch` environments (where TensorFlow is not installed) and, as a
cross-check of the same expectations, in `keras3` on TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

BACKEND = keras.config.backend()

# `jit_compile` values `fit` is tested with: JAX traces with and without
# XLA; PyTorch runs eagerly; TensorFlow's own suite covers its modes, so
# one suffices here.
JIT = {"jax": (True, False), "torch": (False,)}.get(BACKEND, (False,))


def gradients_of(model: keras.Model, x: Any, loss_of: Callable[[Any], Any]) -> list[Any]:
    """The gradients of `loss_of(model outputs on x)` for the model's
    trainable variables, taken the active backend's way, as backend tensors;
    `None` for a variable the loss does not reach (JAX: zeros)."""
    variables = model.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_of(model(x, training=True))
        return tape.gradient(value, variables)
    if BACKEND == "jax":
        import jax

        others = [v.value for v in model.non_trainable_variables]

        def of(values: list[Any]) -> Any:
            y_pred, _ = model.stateless_call(values, others, x, training=True)
            return loss_of(y_pred)

        return jax.grad(of)([v.value for v in variables])
    import torch

    value = loss_of(model(x, training=True))
    return list(torch.autograd.grad(value, [v.value for v in variables], allow_unused=True))


def gradients(model: keras.Model, x: Any, y: Any, sample_weight: Any = None, loss: Any = None) -> list[Any]:
    """The gradients of `loss` (mean squared error) on `(x, y)` for the
    model's trainable variables, as backend tensors."""
    loss = loss or keras.losses.MeanSquaredError()
    return gradients_of(model, x, lambda y_pred: loss(y, y_pred, sample_weight=sample_weight))


def values(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def assert_same(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> None:
    """Bit for bit."""
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert np.array_equal(u, v), (i, np.max(np.abs(u - v)))
