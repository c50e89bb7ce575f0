"""Argument checks shared by the public entry points."""

from __future__ import annotations

import numbers
from typing import Any

REDUCTIONS = ("mean", "sum")
MODES = ("masked", "skip")
WEIGHINGS = ("count", "batch")
SPARSE = ("auto", "rows", "slices")
ACCUMULATOR_DTYPES = ("float32", "bfloat16")


# The largest value the backends' cycle counters hold (`Backend.counter_dtype`).
COUNTER_MAX = {"int64": 2**63 - 1, "int32": 2**31 - 1}


def counter_dtype_of_active() -> str:
    """The counter dtype of the active Keras backend's hooks, known before
    any state exists: int64 on TensorFlow, int32 on JAX and PyTorch."""
    import keras

    return "int64" if keras.config.backend() == "tensorflow" else "int32"


def check_n(n: Any, counter_dtype: str | None = None) -> int:
    """Returns `n` as an int, or raises if it is not an integer >= 1 that
    the cycle's counters hold.

    Args:
        n: The value to check.
        counter_dtype: The counters' dtype (`Backend.counter_dtype`); None
            for the active backend's.

    Raises:
        TypeError: If `n` is not an integer.
        ValueError: If `n` is below 1 or above what the counters hold.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(
            "`n` must be an integer >= 1 (the number of micro-batches per "
            f"update). Received: n={n!r} of type {type(n).__name__}."
        )
    if n < 1:
        raise ValueError(
            "`n` must be an integer >= 1 (the number of micro-batches per "
            f"update). Received: n={n!r}."
        )
    dtype = counter_dtype or counter_dtype_of_active()
    if n > COUNTER_MAX[dtype]:
        raise ValueError(
            f"`n` must be at most {COUNTER_MAX[dtype]}, the largest value the cycle's "
            f"{dtype} counters hold on this backend. Received: n={n!r}."
        )
    return int(n)


def check_reduction(reduction: Any) -> str:
    """Returns `reduction`, or raises if it is not one of `REDUCTIONS`."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}. "
            f"Received: reduction={reduction!r}."
        )
    return reduction


def check_mode(mode: Any) -> str:
    """Returns `mode`, or raises if it is not one of `MODES`."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"`mode` must be one of {MODES}. Received: mode={mode!r}."
        )
    return mode


def check_weigh_by(weigh_by: Any) -> str:
    """Returns `weigh_by`, or raises if it is not one of `WEIGHINGS`."""
    if not isinstance(weigh_by, str) or weigh_by not in WEIGHINGS:
        raise ValueError(
            f"`weigh_by` must be one of {WEIGHINGS}: \"count\" weighs each "
            "micro-batch of `model.fit` by the count its loss was divided by, "
            "\"batch\" weighs every micro-batch alike. "
            f"Received: weigh_by={weigh_by!r}."
        )
    return weigh_by


def check_sparse(sparse: Any) -> str:
    """Returns `sparse`, or raises if it is not one of `SPARSE`."""
    if not isinstance(sparse, str):
        raise TypeError(
            f"`sparse` must be a string, one of {SPARSE}. "
            f"Received: sparse={sparse!r} of type {type(sparse).__name__}."
        )
    if sparse not in SPARSE:
        raise ValueError(
            f"`sparse` must be one of {SPARSE}: \"auto\" keeps `tf.IndexedSlices` "
            "gradients as the large batch has them (slices of lookups of the "
            "batch's ids side by side, those of lookups that do not grow with "
            "the batch summed), \"rows\" adds them into their rows, \"slices\" "
            f"keeps every micro-step's slices. Received: sparse={sparse!r}."
        )
    return sparse


def check_noise_scale(noise_scale: Any) -> bool:
    """Returns `noise_scale`, or raises if it is not a bool."""
    if not isinstance(noise_scale, bool):
        raise TypeError(
            "`noise_scale` must be True (measure the gradient noise scale) or False. "
            f"Received: noise_scale={noise_scale!r} of type {type(noise_scale).__name__}."
        )
    return noise_scale


def check_noise_decay(decay: Any) -> float:
    """Returns the noise scale's moving-average decay, or raises if it is
    not a number in [0, 1)."""
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
        raise TypeError(
            "`noise_decay` must be a number in [0, 1), the decay of the moving averages "
            f"of the noise scale's estimates. Received: noise_decay={decay!r} of type {type(decay).__name__}."
        )
    if not 0.0 <= float(decay) < 1.0:
        raise ValueError(
            "`noise_decay` must be a number in [0, 1), the decay of the moving averages "
            f"of the noise scale's estimates (0: no smoothing). Received: noise_decay={decay!r}."
        )
    return float(decay)


def check_accumulator_dtype(dtype: Any) -> str:
    """Returns the accumulators' dtype name, or raises if it is not one of
    `ACCUMULATOR_DTYPES`."""
    if not isinstance(dtype, str):
        raise TypeError(
            f"`accumulator_dtype` must be a string, one of {ACCUMULATOR_DTYPES}. "
            f"Received: accumulator_dtype={dtype!r} of type {type(dtype).__name__}."
        )
    if dtype not in ACCUMULATOR_DTYPES:
        raise ValueError(
            f"`accumulator_dtype` must be one of {ACCUMULATOR_DTYPES}: \"float32\" sums in float32 "
            "(float64 for float64 variables), \"bfloat16\" in bfloat16 with compensated (Kahan) "
            f"summation. Received: accumulator_dtype={dtype!r}."
        )
    return dtype


def check_n_or_schedule(n: Any) -> int | Any:
    """Returns `n` (an int >= 1) or a schedule (a callable), else raises."""
    if callable(n) and not isinstance(n, type):
        return n
    return check_n(n)


def check_weight_value(value: float) -> None:
    """Raises unless a weight's value is finite and >= 0 (a number, or a
    tensor's value where it is known: eagerly)."""
    if not (value >= 0 and value != float("inf")):
        raise ValueError(
            "`weight` must be a finite number >= 0 (for example the "
            f"micro-batch's sample count). Received: weight={value!r}."
        )


def check_weight(weight: Any) -> Any:
    """Returns `weight`, or raises if a Python number is not finite and >= 0."""
    if weight is None:
        return None
    if isinstance(weight, bool):
        raise TypeError(
            "`weight` must be a non-negative number or a scalar tensor. "
            f"Received: weight={weight!r}."
        )
    if isinstance(weight, numbers.Real):
        check_weight_value(float(weight))
        return float(weight)
    shape = getattr(weight, "shape", None)
    if shape is None:
        raise TypeError(
            "`weight` must be a non-negative number or a scalar tensor. "
            f"Received: {weight!r} of type {type(weight).__name__}."
        )
    # A TensorFlow shape has a rank (None if unknown); the others are tuples.
    rank = shape.rank if hasattr(shape, "rank") else len(shape)
    if rank is not None and rank != 0:
        raise ValueError(
            f"`weight` must be a scalar. Received a tensor of shape {tuple(shape)}."
        )
    return weight


def _positive_number(value: Any, name: str, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a finite number > 0 ({meaning}). "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"`{name}` must be a finite number > 0 ({meaning}). Received: {name}={value!r}."
        )
    return float(value)


def check_agc(agc: Any) -> float | None:
    """Returns the AGC clip factor (None: off), or raises."""
    if agc is None:
        return None
    return _positive_number(
        agc, "agc", "the adaptive clipping factor, for example 0.01; None turns it off"
    )


def check_agc_eps(eps: Any) -> float:
    """Returns AGC's smallest weight norm, or raises."""
    return _positive_number(eps, "agc_eps", "the smallest weight norm a unit's cap is taken from")


def check_agc_exclude(exclude: Any) -> Any:
    """Returns None, a predicate, or a tuple of variables and names, else raises."""
    if exclude is None or (callable(exclude) and not hasattr(exclude, "shape")):
        return exclude
    expected = (
        "`agc_exclude` must be None, a predicate `f(variable) -> bool`, or a "
        "list of variables and variable paths (strings)."
    )
    if isinstance(exclude, (str, bytes)) or hasattr(exclude, "shape"):
        raise TypeError(f"{expected} Received: {exclude!r} of type {type(exclude).__name__}.")
    try:
        entries = tuple(exclude)
    except TypeError:
        raise TypeError(
            f"{expected} Received: {exclude!r} of type {type(exclude).__name__}."
        ) from None
    for entry in entries:
        if not isinstance(entry, str) and not hasattr(entry, "shape"):
            raise TypeError(
                f"{expected} Received an entry {entry!r} of type {type(entry).__name__}."
            )
    return entries


def check_step_arguments(
    grads: Any, variables: Any, built_variables: list[Any] | None
) -> tuple[list[Any], list[Any]]:
    """The gradients and variables of one micro-step, as lists.

    Args:
        grads: One gradient per variable.
        variables: The variables, or None for those the optimizer was built
            for.
        built_variables: Those, or None if the optimizer is not built.

    Raises:
        ValueError: If `variables` is omitted before the optimizer is built,
            or the counts differ.
    """
    grads = list(grads)
    if variables is None:
        if built_variables is None:
            raise ValueError(
                "When `trainable_variables` is omitted the optimizer must "
                "already be built: call `optimizer.build(variables)` first."
            )
        if len(grads) != len(built_variables):
            raise ValueError(
                f"Received {len(grads)} gradients for an optimizer built "
                f"for {len(built_variables)} variables."
            )
        return grads, list(built_variables)
    variables = list(variables)
    if len(grads) != len(variables):
        raise ValueError(f"Received {len(grads)} gradients for {len(variables)} variables.")
    return grads, variables


def _dims(shape: Any) -> list[int | None] | None:
    """A shape's dimensions (None where unknown), or None for an unknown rank."""
    if getattr(shape, "rank", 0) is None:  # a TensorFlow shape of unknown rank
        return None
    return [None if d is None else int(d) for d in shape]


def check_gradient_shapes(grads: list[Any], variables: list[Any], devices: int = 0) -> None:
    """Refuses a gradient whose shape is not its variable's, naming the
    variable (dimensions unknown while tracing are not compared). With
    `devices`, each gradient has a leading axis of that many entries, one per
    device (each device's own gradient), before its variable's shape.

    Raises:
        ValueError: For the first such gradient.
    """
    for grad, variable in zip(grads, variables):
        if grad is None:
            continue
        slices = type(grad).__name__ == "IndexedSlices"  # TensorFlow's, without importing it
        got = _dims(grad.values.shape if slices else grad.shape)
        expected = _dims(variable.shape)
        if devices and expected is not None:
            expected = [devices, *expected]
        if got is None or expected is None:
            continue
        if slices:  # `tf.IndexedSlices`: rows of the variable
            got, expected = got[1:], expected[1:]
        if len(got) != len(expected) or any(a is not None and b is not None and a != b for a, b in zip(got, expected)):
            name = getattr(variable, "path", None) or getattr(variable, "name", repr(variable))
            what = "rows of shape" if slices else "shape"
            raise ValueError(
                f"The gradient for variable {name!r} has {what} {tuple(got)}, but the variable's are "
                f"{tuple(expected)}: each gradient must have its variable's shape."
            )


def check_micro_batch_size(size: Any) -> int | str | None:
    """Returns `micro_batch_size` (None, an int >= 1 or `"auto"`), else raises."""
    expected = (
        "`micro_batch_size` must be an integer >= 1 (the samples of one micro-batch inside "
        "`model.fit`'s train step) or \"auto\" (the largest micro-batch whose step fits the memory)."
    )
    if size is None or size == "auto":
        return size
    if isinstance(size, str):
        raise ValueError(f"{expected} Received: micro_batch_size={size!r}.")
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"{expected} Received: micro_batch_size={size!r} of type {type(size).__name__}.")
    if size < 1:
        raise ValueError(f"{expected} Received: micro_batch_size={size!r}.")
    return int(size)


def check_memory_limit(limit: Any) -> int | None:
    """Returns `memory_limit` (None, or an int number of bytes >= 1), else raises."""
    expected = (
        "`memory_limit` must be an integer number of bytes >= 1 (what the train step may use on "
        "the device, with micro_batch_size=\"auto\")."
    )
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
        raise TypeError(f"{expected} Received: memory_limit={limit!r} of type {type(limit).__name__}.")
    if limit < 1:
        raise ValueError(f"{expected} Received: memory_limit={limit!r}.")
    return int(limit)


def check_n_or_micro_batch_size(n: Any, micro_batch_size: Any) -> None:
    """Raises unless exactly one of `n` and `micro_batch_size` is given."""
    if n is None and micro_batch_size is None:
        raise TypeError(
            "accumulate() requires `n`, the number of micro-batches per update, or "
            "`micro_batch_size`, the samples of one micro-batch inside `model.fit`'s train step."
        )
    if n is not None and micro_batch_size is not None:
        raise ValueError(
            "Pass either `n` (micro-batches per update, across train steps) or `micro_batch_size` "
            "(each train step's batch split into micro-batches of that size), not both. "
            f"Received: n={n!r}, micro_batch_size={micro_batch_size!r}."
        )
