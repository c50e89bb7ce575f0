"""Keras configs: an `AccumulatingOptimizer` serializes as itself.

Keras serializes an object by its `__class__`, which a proxy reports as the
wrapped optimizer's. `register` therefore makes Keras's
`serialize_keras_object` write an `AccumulatingOptimizer` as itself: a config
with the wrapped optimizer's serialized config, `n`, `reduction`, `mode`,
`weigh_by`, `sparse` and adaptive clipping's `agc`, `agc_eps` and
`agc_exclude` (the paths of the variables left out, or a predicate serialized
as Keras serializes any function: a registered one round-trips, a lambda
needs `safe_mode=False`, as for a schedule of `n`), under the registered name
`gradaccum>AccumulatingOptimizer`, so that
`load_model` needs no `custom_objects` once `gradaccum` is imported, under
`safe_mode=True` too. `opt.get_config()` is still the wrapped optimizer's.
(The state of a partial cycle is saved with the variables, by
`gradaccum._state`.)
"""

from __future__ import annotations

from typing import Any

import keras

from gradaccum import _agc, _patches
from gradaccum._validation import check_agc, check_agc_eps, check_agc_exclude

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
        "agc": proxy.agc,
        "agc_eps": proxy.agc_eps,
        "agc_exclude": _exclusion_config(proxy.agc_exclude),
    }
    return {
        "module": "gradaccum",
        "class_name": "AccumulatingOptimizer",
        "config": config,
        "registered_name": REGISTERED_NAME,
    }


def _exclusion_config(exclude: Any) -> Any:
    from keras.src.saving import serialization_lib

    if exclude is None:
        return None
    if callable(exclude):
        return serialization_lib.serialize_keras_object(exclude)
    return [e if isinstance(e, str) else _agc.variable_path(e) for e in exclude]


def arguments(config: dict, custom_objects: Any = None) -> tuple[Any, Any, str, str, str, str, Any]:
    """`(optimizer, n, reduction, mode, weigh_by, sparse, agc)` from a config
    `config_of` wrote (one written before a setting existed gets its
    default); `agc` is an `AdaptiveClipping` or None.

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
    exclude = config.get("agc_exclude")
    if isinstance(exclude, dict):
        exclude = keras.saving.deserialize_keras_object(exclude, custom_objects=custom_objects)
    agc = _agc.clipping(
        check_agc(config.get("agc")),
        check_agc_eps(config.get("agc_eps", 1e-3)),
        check_agc_exclude(exclude),
    )
    return (
        optimizer,
        n,
        config.get("reduction", "mean"),
        config.get("mode", "masked"),
        config.get("weigh_by", "count"),
        config.get("sparse", "rows"),
        agc,
    )


def register(cls: type) -> None:
    """Registers `cls` with Keras and makes Keras serialize it as itself."""
    from keras.src.saving import object_registration

    object_registration.GLOBAL_CUSTOM_OBJECTS[REGISTERED_NAME] = cls
    object_registration.GLOBAL_CUSTOM_NAMES[cls] = REGISTERED_NAME
    _patches.serialize_as(cls, config_of)
