"""Gradients and losses on TensorFlow (`gradaccum._backend.Gradients`):
`tf.IndexedSlices`, and shapes a traced step knows only at run time."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gradaccum._backend.tensorflow import tensors


class TensorFlowGradients:
    """The hooks of `gradaccum._backend.Gradients` on TensorFlow."""

    def is_slices(self, grad: Any) -> bool:
        return isinstance(grad, tf.IndexedSlices)

    def densify(self, grad: Any) -> Any:
        return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad

    def scale_gradient(self, grad: Any, factor: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
        return grad * tf.cast(factor, grad.dtype)

    def shape_and_entries(self, values: Any, weight: Any) -> tuple[tuple[int | None, ...] | None, Any]:
        # A traced step may know neither the batch size nor the rank.
        static, dynamic = values.shape, tf.shape(values)
        if weight is not None:
            static = tf.broadcast_static_shape(values.shape, weight.shape)
            dynamic = tf.broadcast_dynamic_shape(tf.shape(values), tf.shape(weight))
        entries = tf.cast(tf.reduce_prod(dynamic), tf.float32)
        return (None if static.rank is None else tuple(static.as_list())), entries

    def usable_here(self, value: Any) -> bool:
        return tensors.usable_here(value)

    def no_op(self) -> Any:
        return tf.no_op()

    def delegate_tracking(self, optimizer: Any, inner: Any) -> None:
        delegating = tf.__internal__.tracking.DelegatingTrackableMixin
        if isinstance(optimizer, delegating):
            delegating.__init__(optimizer, inner)
