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
