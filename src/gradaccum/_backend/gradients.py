"""The hooks the layers above the core use on gradients and losses, in Keras
ops: for JAX and PyTorch, whose gradients are all dense and whose shapes are
all known, also while traced. TensorFlow's hooks (`tensorflow/backend.py`)
give their own, for `tf.IndexedSlices` and shapes known only at run time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops


class KerasOpsGradients:
    """The hooks of `gradaccum._backend.Gradients` in Keras ops."""

    def is_slices(self, grad: Any) -> bool:
        return False

    def densify(self, grad: Any) -> Any:
        return grad

    def scale_gradient(self, grad: Any, factor: Any) -> Any:
        return grad * ops.cast(factor, grad.dtype)

    def shape_and_entries(self, values: Any, weight: Any) -> tuple[tuple[int | None, ...] | None, Any]:
        shape = tuple(values.shape)
        if weight is not None:
            shape = tuple(np.broadcast_shapes(shape, tuple(weight.shape)))
        return shape, ops.convert_to_tensor(float(np.prod(shape, dtype=np.int64)), dtype="float32")

    def usable_here(self, value: Any) -> bool:
        return True

    def no_op(self) -> Any:
        return None

    def delegate_tracking(self, optimizer: Any, inner: Any) -> None:
        return None
