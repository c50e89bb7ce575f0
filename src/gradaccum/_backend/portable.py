"""Writes, branches and snapshots on JAX and PyTorch, where optimizers run on Keras ops.

On JAX, `model.fit` and `optimizer.stateless_apply` run the optimizer inside
a `StatelessScope`, usually traced by `jax.jit`: a variable's write is
recorded by the scope, and a branch on a traced value must be a
`jax.lax.cond` of pure functions. PyTorch runs eagerly: a write changes the
tensor in place, so a value kept for later must be copied first, and a
branch is Python's `if`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
from keras.src.backend.common.stateless_scope import StatelessScope


def is_traced(value: Any) -> bool:
    """Whether `value` is a JAX tracer (its value unknown while tracing)."""
    if keras.config.backend() != "jax":
        return False
    import jax

    return isinstance(value, jax.core.Tracer)


def snapshot(variable: Any) -> Any:
    """The variable's current value, unchanged by later writes to it."""
    value = variable.value
    if keras.config.backend() == "torch":
        # A write copies into the tensor the variable holds.
        return value.detach().clone()
    return value


def add_into(accumulator: Any, grad: Any, weight: Any = None, fresh: Any = False) -> None:
    """`accumulator += grad * weight` (or `+= grad`), in place on PyTorch.

    If `fresh` (a cycle's first micro-step), the accumulator is set to the
    gradient instead: what it held belongs to the cycle already applied (see
    `gradaccum._portable.state`). Traced, that choice is one select fused
    with the addition, which XLA writes into the accumulator's own buffer.
    """
    ops = keras.ops
    grad = ops.cast(grad, accumulator.dtype)
    if weight is not None:
        grad = grad * ops.cast(weight, accumulator.dtype)
    if is_traced(fresh):
        accumulator.assign(ops.where(fresh, grad, accumulator.value + grad))
    elif keras.config.backend() == "torch":
        if bool(fresh):
            accumulator.value.copy_(grad)
        else:
            accumulator.value.add_(grad)
    else:
        accumulator.assign(grad if bool(fresh) else accumulator.value + grad)


def clear_if(accumulator: Any, fresh: Any) -> None:
    """Zeroes the accumulator if `fresh`: for a variable that takes part in
    updates but has no gradient in a cycle's first micro-step."""
    if is_traced(fresh):
        value = accumulator.value
        accumulator.assign(keras.ops.where(fresh, keras.ops.zeros_like(value), value))
    elif bool(fresh):
        clear(accumulator)


def quotient(value: Any, divisor: Any) -> Any:
    """`value / divisor` for a scalar `divisor`, as an elementwise division.

    Run eagerly, the divisor is broadcast first: XLA turns a division by a
    scalar into a multiplication by its reciprocal, which rounds differently
    from the division TensorFlow, PyTorch and NumPy do. Inside `jax.jit` it
    does so either way, and there a broadcast divisor would cost a tensor of
    the value's size (measured: twice the parameter bytes of extra peak
    memory, and 1.8 times the plain step's time in skip mode), so there the
    scalar is divided by as it is.
    """
    ops = keras.ops
    divisor = ops.cast(divisor, value.dtype)
    if is_traced(value):
        return value / divisor
    return value / ops.broadcast_to(divisor, ops.shape(value))


def divide_in_place(accumulator: Any, divisor: Any) -> Any:
    """Divides the accumulator by a scalar (in place on PyTorch); returns
    its new value."""
    if keras.config.backend() == "torch":
        return accumulator.value.div_(keras.ops.cast(divisor, accumulator.dtype))
    accumulator.assign(quotient(accumulator.value, divisor))
    return accumulator.value


def clear(accumulator: Any) -> None:
    """Zeroes the accumulator (in place on PyTorch)."""
    if keras.config.backend() == "torch":
        accumulator.value.zero_()
    else:
        accumulator.assign(keras.ops.zeros_like(accumulator.value))


def run_if(condition: Any, fn: Callable[[], None], variables: Sequence[Any]) -> None:
    """Runs `fn` (which writes some of `variables`) only if `condition`.

    Where `condition` is known (PyTorch, JAX outside `jit`) this is Python's
    `if`. Traced by JAX, it is a `jax.lax.cond` whose taken branch runs `fn`
    in a `StatelessScope` over the values of `variables` and returns their
    new values, and whose other branch returns them unchanged; those values
    are then written to `variables`. Everything `fn` reads or writes must be
    among `variables`.
    """
    if not is_traced(condition):
        if bool(condition):
            fn()
        return
    import jax

    variables = list(variables)

    def taken(values: list[Any]) -> list[Any]:
        with StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            fn()
        return [scope.get_current_value(v) for v in variables]

    values = jax.lax.cond(condition, taken, lambda values: list(values), [v.value for v in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)
