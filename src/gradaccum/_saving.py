"""Keras configs: an `AccumulatingOptimizer` serializes as itself.

Keras serializes an object by its `__class__`, which a proxy reports as the
wrapped optimizer's. `register` therefore makes Keras's
`serialize_keras_object` write an `AccumulatingOptimizer` as itself: a config
with the wrapped optimizer's serialized config, `n`, `reduction`, `mode` and
`weigh_by` and `sparse`,
under the registered name `gradaccum>AccumulatingOptimizer`, so that
`load_model` needs no `custom_objects` once `gradaccum` is imported, under
`safe_mode=True` too. `opt.get_config()` is still the wrapped optimizer's.
(The state of a partial cycle is saved with the variables, by
`gradaccum._state`.)
"""

from __future__ import annotations

from typing import Any

import keras

from gradaccum import _patches

REGISTERED_NAME = "gradaccum>AccumulatingOptimizer"


def config_of(proxy: Any) -> dict:
    """What `serialize_keras_object` writes for an `AccumulatingOptimizer`."""
    from keras.src.saving import serialization_lib

    n = proxy.n
    config = {
        "optimizer": serialization_lib.serialize_keras_object(proxy.__wrapped__),
        # A schedule is serialized as Keras serializes any function.
        "n": n if isinstance(n, int) else serialization_lib.serialize_keras_object(n),
        "reduction": proxy.reduction,
        "mode": proxy.mode,
        "weigh_by": proxy.weigh_by,
        "sparse": proxy.sparse,
    }
    return {
        "module": "gradaccum",
        "class_name": "AccumulatingOptimizer",
        "config": config,
        "registered_name": REGISTERED_NAME,
    }


def arguments(config: dict, custom_objects: Any = None) -> tuple[Any, Any, str, str, str, str]:
    """`(optimizer, n, reduction, mode, weigh_by, sparse)` from a config
    `config_of` wrote (one written before `weigh_by` or `sparse` existed
    gets its default).

    Raises:
        ValueError: If `config` lacks `optimizer` or `n`.
    """
    missing = {"optimizer", "n"} - set(config)
    if missing:
        raise ValueError(
            f"An AccumulatingOptimizer config needs {sorted(missing)}. "
            f"Received keys: {sorted(config)}."
        )
    optimizer = keras.saving.deserialize_keras_object(
        config["optimizer"], custom_objects=custom_objects
    )
    n = config["n"]
    if not isinstance(n, int):
        n = keras.saving.deserialize_keras_object(n, custom_objects=custom_objects)
    return (
        optimizer,
        n,
        config.get("reduction", "mean"),
        config.get("mode", "masked"),
        config.get("weigh_by", "count"),
        config.get("sparse", "rows"),
    )


def register(cls: type) -> None:
    """Registers `cls` with Keras and makes Keras serialize it as itself."""
    from keras.src.saving import object_registration

    object_registration.GLOBAL_CUSTOM_OBJECTS[REGISTERED_NAME] = cls
    object_registration.GLOBAL_CUSTOM_NAMES[cls] = REGISTERED_NAME
    _patches.serialize_as(cls, config_of)
