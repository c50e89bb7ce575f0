"""The tensor work of a micro-step in Keras ops (`Tensors`), and one replica
(`OneReplica`): JAX's, and what PyTorch's hooks override
(`gradaccum._backend.pytorch`). Traced by JAX, each choice on a cycle's
first micro-step is a select that XLA fuses with the write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops


def is_traced(value: Any) -> bool:
    """Whether `value` is a JAX tracer (its value unknown while tracing)."""
    if keras.config.backend() != "jax":
        return False
    import jax

    return isinstance(value, jax.core.Tracer)


class KerasOpsTensors:
    """The hooks of `gradaccum._backend.Tensors` in Keras ops.

    Args:
        local: The device-local accumulators (by id): their number of
            devices (see `gradaccum._backend.device_local`).
    """

    def __init__(self, local: dict[int, int]):
        self._local = local

    def add_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        # Traced, the choice is one select fused with the addition, which
        # XLA writes into the accumulator's own buffer.
        for accumulator, grad in zip(accumulators, grads):
            grad = ops.cast(grad, accumulator.dtype)
            size = self._local.get(id(accumulator))
            if size is not None and len(grad.shape) < len(accumulator.shape):
                # A gradient already summed over the devices (a custom loop,
                # or a step that cannot compute them per device): it counts
                # once, in the first device's entry. Multiplying by 0 and 1
                # keeps it exact, and moves nothing between devices.
                first_entry = ops.reshape(ops.one_hot(0, size, dtype=grad.dtype), (size,) + (1,) * len(grad.shape))
                grad = first_entry * grad[None]
            if weight is not None:
                scale = ops.cast(weight, accumulator.dtype)
                if len(scale.shape) == 1:  # one weight per device
                    scale = ops.reshape(scale, (-1,) + (1,) * (len(grad.shape) - 1))
                grad = grad * scale
            if is_traced(first):
                accumulator.assign(ops.where(first, grad, accumulator.value + grad))
            else:
                accumulator.assign(grad if bool(first) else accumulator.value + grad)

    def max_into(self, accumulators: Sequence[Any], values: Sequence[Any], first: Any) -> None:
        for accumulator, value in zip(accumulators, values):
            value = ops.cast(value, accumulator.dtype)
            accumulator.assign(ops.where(first, value, ops.maximum(accumulator.value, value)))

    def add_scalar(self, total: Any, value: Any, first: Any) -> None:
        value = ops.cast(value, total.dtype)
        if len(value.shape) == 1:
            # One weight per device: the micro-batch's is their sum (a
            # scalar all-reduce, as the step's loss has anyway).
            value = ops.sum(value)
        total.assign(ops.where(first, value, total.value + value))

    def squared_norm(self, values: Sequence[Any]) -> Any:
        parts = [ops.sum(ops.square(ops.cast(v, "float32"))) for v in values]
        return ops.sum(ops.stack(parts)) if parts else ops.convert_to_tensor(0.0, "float32")

    def add_squared_norm(self, total: Any, values: Sequence[Any], weight: Any, first: Any) -> None:
        square = self.squared_norm(values)
        self.add_scalar(total, square if weight is None else square * ops.cast(weight, "float32"), first)

    def zero_if(self, condition: Any, variables: Sequence[Any]) -> None:
        for variable in variables:
            if is_traced(condition):
                value = variable.value
                variable.assign(ops.where(condition, ops.zeros_like(value), value))
            elif bool(condition):
                variable.assign(ops.zeros_like(variable.value))

    def any_nonzero(self, variables: Sequence[Any]) -> Any:
        return ops.any(ops.stack([ops.any(ops.not_equal(v, 0)) for v in variables]))

    def assert_that(self, condition: Callable[[], Any], message: str) -> Any:
        return None  # no cheap run-time assertion: JAX checks nothing at run time

    def guarded(self, condition: Callable[[], Any], message: str) -> Any:
        return contextlib.nullcontext(False)  # no cheap run-time assertion (see `gradaccum._cycle`)


class OneReplica:
    """The hooks of `gradaccum._backend.Replicas` without `tf.distribute`."""

    def count(self) -> int:
        return 1

    def index(self) -> int:
        return 0

    def sum(self, values: Any) -> Any:
        return values

    def clip_as_one_device(self, grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
        return clip(grads)

    def on_each(self, family: Any, fn: Callable[[], None]) -> None:
        fn()

    def strategy_of(self, optimizer: Any) -> Any:
        return None

    def check_buildable(self, family: Any) -> None:
        return None

    def native(self, variable: Any) -> Any:
        return variable

    def apply_masked(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], masking: Any) -> None:
        raise NotImplementedError(
            f"The {keras.config.backend()!r} backend runs an optimizer's update whole: it has no `masking`."
        )

    def local_axis(self) -> tuple[Any, str | None]:
        return None, None

    def local_devices(self, accumulator: Any) -> int:
        return 0
