"""Adaptive gradient clipping in NumPy: the reference the AGC tests compare to.

Written from the paper's reference code (Brock et al. 2021, `unitwise_norm`
and `my_clip` in the NFNets repository), independently of
`gradaccum._agc`, in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def np_unit_norm(a: np.ndarray) -> np.ndarray:
    """The norm of each output unit (one number for vectors and scalars)."""
    a = a.astype(np.float64)
    if np.squeeze(a).ndim <= 1:
        return np.sqrt(np.sum(a * a))
    if a.ndim in (2, 3):
        return np.sqrt(np.sum(a * a, axis=0, keepdims=True))
    if a.ndim == 4:
        return np.sqrt(np.sum(a * a, axis=(0, 1, 2), keepdims=True))
    raise ValueError(a.shape)


def np_agc(g: np.ndarray, w: np.ndarray, factor: float, eps: float):
    """`(g clipped, as float32; units clipped; units left as they were)`."""
    max_norm = np.maximum(np_unit_norm(w), eps) * factor
    grad_norm = np_unit_norm(g)
    trigger = grad_norm < max_norm
    clipped = g * (max_norm / np.maximum(grad_norm, 1e-6))
    out = np.where(trigger, g, clipped).astype(np.float32)
    return out, int(np.sum(~trigger)), int(np.sum(trigger))


def train_clipped(
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any] | None,
    x: np.ndarray,
    y: np.ndarray,
    batch: int,
    factor: float,
    eps: float,
    exclude: Callable[[Any], bool] = lambda v: False,
) -> tuple[int, int]:
    """Trains the plain `optimizer` on batches of `batch` in order, each
    gradient clipped by `np_agc` (variables `exclude` names left as they
    are). Works for Keras 3 on every backend and for tf_keras.

    Returns `(units clipped, units left)` over all steps.
    """
    import keras

    from tests.helpers.training import BACKEND, gradients

    def numpy(g: Any) -> np.ndarray:
        if BACKEND == "tensorflow":  # an `IndexedSlices` too
            import tensorflow as tf

            return tf.convert_to_tensor(g).numpy()
        return np.asarray(keras.ops.convert_to_numpy(g))

    clipped = left = 0
    for start in range(0, len(x), batch):
        grads = gradients(model, x[start : start + batch], y[start : start + batch], loss=loss_fn)
        new = []
        for g, v in zip(grads, model.trainable_variables):
            if exclude(v):
                new.append(g)
                continue
            c, k, m = np_agc(numpy(g), np.asarray(keras.ops.convert_to_numpy(v)), factor, eps)
            clipped, left = clipped + k, left + m
            new.append(keras.ops.convert_to_tensor(c))
        optimizer.apply_gradients(zip(new, model.trainable_variables))
    return clipped, left
