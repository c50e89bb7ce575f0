"""Argument checks shared by the public entry points."""

from __future__ import annotations

import numbers
from typing import Any

_REDUCTIONS = ("mean", "sum")
_MODES = ("masked", "skip")


def _check_n(n: Any) -> int:
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


def _check_reduction(reduction: Any) -> str:
    """Returns `reduction`, or raises if it is not one of `_REDUCTIONS`."""
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {_REDUCTIONS}. "
            f"Received: reduction={reduction!r}."
        )
    return reduction


def _check_mode(mode: Any) -> str:
    """Returns `mode`, or raises if it is not one of `_MODES`."""
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(
            f"`mode` must be one of {_MODES}. Received: mode={mode!r}."
        )
    return mode
