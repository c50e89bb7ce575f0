"""Argument checks shared by the public entry points."""

from __future__ import annotations

import numbers
from typing import Any

REDUCTIONS = ("mean", "sum")
MODES = ("masked", "skip")
WEIGHINGS = ("count", "batch")
SPARSE = ("rows", "slices")


def check_n(n: Any) -> int:
    """Returns `n` as an int, or raises if it is not an integer >= 1."""
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
            f"`sparse` must be one of {SPARSE}: \"rows\" adds `tf.IndexedSlices` "
            "gradients into their rows, \"slices\" keeps the cycle's slices "
            f"as the large batch has them. Received: sparse={sparse!r}."
        )
    return sparse


def check_n_or_schedule(n: Any) -> int | Any:
    """Returns `n` (an int >= 1) or a schedule (a callable), else raises."""
    if callable(n) and not isinstance(n, type):
        return n
    return check_n(n)


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
        if not (weight >= 0 and weight != float("inf")):
            raise ValueError(
                "`weight` must be a finite number >= 0 (for example the "
                f"micro-batch's sample count). Received: weight={weight!r}."
            )
        return float(weight)
    shape = getattr(weight, "shape", None)
    if shape is None:
        raise TypeError(
            "`weight` must be a non-negative number or a scalar tensor. "
            f"Received: {weight!r} of type {type(weight).__name__}."
        )
    if shape.rank is not None and shape.rank != 0:
        raise ValueError(
            f"`weight` must be a scalar. Received a tensor of shape {shape}."
        )
    return weight
