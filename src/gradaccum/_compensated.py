"""Compensated (Kahan) summation into bfloat16 accumulators.

With `accumulator_dtype="bfloat16"` each accumulator `a` has a bfloat16
compensation `c` beside it, and the cycle's sum is `a - c`: `a` holds the
sum rounded to bfloat16 and `-c` what that rounding lost (rounded to
bfloat16 in turn). Each micro-step computes, in float32,

    s = a - c + w * g        (s = w * g on a cycle's first micro-step)
    a = bfloat16(s)
    c = bfloat16(a - s)

so a rounding error is carried into the next addition instead of being
lost, as in Kahan's summation: the sum keeps about 16 significant bits
where a bfloat16 sum keeps 8, whatever `n`. The two bfloat16 buffers take
the memory of one float32 accumulator (docs/guides/accumulator-dtype.md measures
both). Written once with Keras ops and the backend's `read`/`assign`, for
every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops


def add(backend: Any, accumulators: Sequence[Any], compensations: Sequence[Any], grads: Sequence[Any],
        weight: Any, first: Any) -> None:
    """Adds `weight * grad` (or `grad`) into each accumulator and its
    compensation; writes over both on a cycle's first micro-step (`first`,
    a Python bool where the backend keeps the position on the host)."""
    for accumulator, compensation, grad in zip(accumulators, compensations, grads):
        # A `tf.IndexedSlices` is added as its dense gradient.
        value = ops.cast(ops.convert_to_tensor(grad), "float32")
        if weight is not None:
            value = value * ops.cast(weight, "float32")
        if first is True:
            total = value
        else:
            total = held(backend, accumulator, compensation) + value
            if first is not False:
                total = ops.where(first, value, total)
        dtype = keras.backend.standardize_dtype(accumulator.dtype)
        rounded = ops.cast(total, dtype)
        backend.assign(accumulator, rounded)
        backend.assign(compensation, ops.cast(ops.cast(rounded, "float32") - total, dtype))


def held(backend: Any, accumulator: Any, compensation: Any) -> Any:
    """The compensated sum `a - c`, in float32."""
    a = ops.cast(backend.read(accumulator), "float32")
    return a - ops.cast(backend.read(compensation), "float32")
