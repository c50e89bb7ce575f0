"""Exact gradient accumulation for any Keras optimizer.

Public names: `accumulate`, `accumulating`, `AccumulatingOptimizer`,
`AccumulationState`, and the submodules `gradaccum.callbacks`,
`gradaccum.layers` and `gradaccum.schedules` (imported when first used). Every other module is
private (its name starts with `_`); docs/ARCHITECTURE.md says what each one
owns. Importing gradaccum changes nothing in Keras: see `gradaccum._patches`.
"""

from __future__ import annotations

import importlib
from typing import Any

from gradaccum import _quiet

if _quiet.started_as(_quiet.DEMO):
    # The names below import Keras, and Keras its backend, before the demo
    # runs: their start-up messages would come before its first line.
    _quiet.import_keras()

from gradaccum._accumulating import accumulating
from gradaccum._api import accumulate
from gradaccum._proxy import AccumulatingOptimizer
from gradaccum._view import AccumulationState

__all__ = [
    "AccumulatingOptimizer",
    "AccumulationState",
    "accumulate",
    "accumulating",
    "callbacks",
    "layers",
    "schedules",
]
__version__ = "0.1.0"

_SUBMODULES = ("callbacks", "layers", "schedules")


def __getattr__(name: str) -> Any:
    # `gradaccum.layers` installs its patches when imported: only on use.
    if name in _SUBMODULES:
        return importlib.import_module(f"gradaccum.{name}")
    raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")
