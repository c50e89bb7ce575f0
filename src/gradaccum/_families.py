"""Which optimizer family an optimizer belongs to.

Keras 3's family is always known. `tf_keras`'s families are added when
`tf_keras` is imported (by its users; `import gradaccum` never imports it),
through a wrapt post-import hook, which runs at once if it is imported
already.
"""

from __future__ import annotations

from typing import Any

import wrapt

from gradaccum._family import OptimizerFamily
from gradaccum._keras3 import Keras3Family

_FAMILIES: list[type] = [Keras3Family]


def _add_tf_keras(module: Any) -> None:
    from gradaccum._tf_keras import FAMILIES

    for family in FAMILIES:
        if family not in _FAMILIES:
            _FAMILIES.append(family)


wrapt.register_post_import_hook(_add_tf_keras, "tf_keras")


def family_of(optimizer: Any) -> OptimizerFamily | None:
    """The family that takes `optimizer`, around it, or None."""
    for family in _FAMILIES:
        if family.accepts(optimizer):
            return family(optimizer)
    return None


def names() -> str:
    """The known families, for messages."""
    return ", ".join(f.name for f in _FAMILIES)


def accumulates(optimizer: Any) -> bool:
    """Whether `optimizer` is an accumulating optimizer already."""
    return getattr(optimizer, "_self_core", None) is not None


def core_in(optimizer: Any) -> Any:
    """The accumulating core of `optimizer` (itself an accumulating optimizer
    or a loss-scale optimizer around one), or None."""
    seen = optimizer
    while seen is not None:
        core = getattr(seen, "_self_core", None)
        if core is not None:
            return core
        seen = getattr(seen, "inner_optimizer", None)
    return None


def wrappable(optimizer: Any) -> OptimizerFamily:
    """The family of `optimizer`, or raises if it cannot be wrapped.

    Raises:
        TypeError: If `optimizer` is not an optimizer of a known family.
        ValueError: If it accumulates already (itself or inside a loss-scale
            optimizer), or has its own accumulation.
    """
    if accumulates(optimizer):
        raise ValueError(
            "`optimizer` is already an AccumulatingOptimizer "
            f"(n={optimizer.n}); wrapping it again would accumulate twice. "
            "Pass the plain optimizer, or set the number of micro-batches "
            "on the existing wrapper."
        )
    family = family_of(optimizer)
    if family is None:
        hint = ""
        if isinstance(optimizer, (int, type)) or callable(optimizer):
            hint = " To decorate an optimizer class or factory, call `accumulate(n=...)` with `n` as a keyword."
        raise TypeError(
            f"`optimizer` must be an optimizer instance ({names()}). "
            f"Received: {optimizer!r} of type {type(optimizer).__name__}.{hint}"
        )
    attribute = family.inner_attribute()
    if attribute is not None and accumulates(getattr(optimizer, attribute)):
        raise ValueError(
            "`optimizer` is a loss-scale optimizer around an "
            "AccumulatingOptimizer already; wrapping it would accumulate twice."
        )
    family.check()
    return family
