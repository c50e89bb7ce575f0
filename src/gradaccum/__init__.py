"""Exact gradient accumulation for any Keras optimizer.

Public names: `accumulate`, `accumulating`, `AccumulatingOptimizer`,
`AccumulationState`, and the submodules `gradaccum.callbacks`,
`gradaccum.layers` and `gradaccum.schedules` (imported when first used). Every other module is
private (its name starts with `_`); docs/ARCHITECTURE.md says what each one
owns. Importing gradaccum changes nothing in Keras: see `gradaccum._patches`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
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
_NAMES = {
    "AccumulatingOptimizer": "gradaccum._proxy",
    "AccumulationState": "gradaccum._view",
    "accumulate": "gradaccum._api",
    "accumulating": "gradaccum._accumulating",
}


def _load(_keras: Any = None) -> None:
    """Imports the public names, which need Keras.

    Runs when Keras has been imported (at once if it already was): importing
    gradaccum imports no Keras, and so no TensorFlow, by itself, so that
    `python -m gradaccum.demo` can silence TensorFlow's start-up messages,
    which this package is imported before. Importing the names registers the
    accumulating optimizer with Keras's saving, so files that hold one load
    once Keras is imported, as before any name is used.
    """
    for name, module in _NAMES.items():
        globals()[name] = getattr(importlib.import_module(module), name)


wrapt.register_post_import_hook(_load, "keras")


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        _load()
        return globals()[name]
    # `gradaccum.layers` installs its patches when imported: only on use.
    if name in _SUBMODULES:
        return importlib.import_module(f"gradaccum.{name}")
    raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
