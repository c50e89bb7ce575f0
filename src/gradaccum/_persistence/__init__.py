"""Everything that persists of an accumulating optimizer, in one place.

- **Keras files** (`.keras`, `.weights.h5`): the accumulation state goes under
  `gradaccum_*` keys beside the wrapped optimizer's own (`snapshot`,
  `restore`), the same on every backend, so a file written on one resumes its
  partial cycle on another. Each accumulator's variable is named
  (`gradaccum_names`, paths relative to what they share), so a model that
  lists its variables in another order once reloaded gets each sum back on
  its variable. A file loaded into an unbuilt optimizer is held until it is
  built (`Saved`). State written with another `n` or `reduction` is refused.
- **TensorFlow checkpoints** (`tf.train.Checkpoint`, `BackupAndRestore`,
  SavedModel) reach the state through a child of the optimizer named
  `gradient_accumulation` (`Saved.children`), a `tf.Module` holding the
  accumulators, the counters and the kept slices, and as tensors the `n` and
  `reduction` the state was written with and which variables take part.
- **Configs, pickles and copies**: an accumulating optimizer serializes as
  itself (`config_of`, registered with Keras as
  `gradaccum>AccumulatingOptimizer`): the wrapped optimizer's config and the
  settings (`gradaccum._settings.Settings.to_config`). A pickle or a copy is
  a new accumulating optimizer with the same settings around what Keras
  makes of the wrapped one; like Keras's slots, a built one's accumulators
  are not copied.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from gradaccum import _auto_size
from gradaccum._persistence.checkpoint import CHILD, checkpoint_class
from gradaccum._persistence.keras_files import (
    KEY,
    UNTRACKED,
    check_model,
    check_store,
    owns_key,
    read_store,
    restore,
    snapshot,
)
from gradaccum._settings import Settings
from gradaccum._state import State

REGISTERED_NAME = "gradaccum>AccumulatingOptimizer"
# The config's key of the size micro_batch_size="auto" chose.
_CHOSEN = "chosen_micro_batch_size"


class Saved:
    """What persists of one accumulating optimizer's own state: its Keras-file
    state (held while the optimizer is unbuilt) and its checkpoint child.

    Args:
        optimizer: The wrapped optimizer (not a loss-scale one).
        family: Its family.
        core: The `gradaccum._core.Core` it accumulates with (set later).
    """

    def __init__(self, optimizer: Any, family: Any):
        self.optimizer = optimizer
        self.family = family
        self.core: Any = None
        # What a Keras file loaded before the optimizer was built.
        self._held: dict[str, np.ndarray] | None = None

    def on_built(self, state: State) -> None:
        """Makes the checkpoint child (TensorFlow) and restores what a
        checkpoint held for it before it existed."""
        if keras.config.backend() != "tensorflow":
            return
        state.checkpoint = checkpoint_class()(state, self.core)
        self.optimizer._handle_deferred_dependencies(name=CHILD, trackable=state.checkpoint)

    def children(self, save_type: str, **kwargs: Any) -> dict[str, Any]:
        children = dict(self.optimizer._trackable_children(save_type, **kwargs))
        state = self.core.state
        if state is not None and state.checkpoint is not None:
            children[CHILD] = state.checkpoint
        return children

    def lookup(self, name: str, cached_dependencies: Any = None) -> Any:
        if name == CHILD:
            state = self.core.state
            return None if state is None else state.checkpoint
        return self.optimizer._lookup_dependency(name, cached_dependencies)

    def save(self, store: Any) -> None:
        """Saves the wrapped optimizer's variables and the accumulation state
        (unbuilt but holding values loaded from a file: those)."""
        core = self.core
        if self._held is not None and not core.built:
            for key, value in self._held.items():
                store[key] = value
            return
        self.optimizer.save_own_variables(store)
        # Built by a LossScaleOptimizer, the wrapped optimizer lists no
        # variable its `build` created directly (Nadam's `_u_product`).
        for k, v in enumerate(self.family.untracked_variables()):
            store[f"{UNTRACKED}{k}"] = np.asarray(keras.ops.convert_to_numpy(v))
        if core.state is not None:
            for key, value in snapshot(core.state, core.backend, core.cycle.code, core.settings.reduction).items():
                store[key] = value

    def load(self, store: Any) -> None:
        """Loads what `save` wrote, now if built, else once built (by `build`
        or the first step). A store of the plain optimizer loads into the
        wrapped one and leaves the accumulators empty.

        Raises:
            ValueError: If the store was written with another `n` or
                `reduction` (at once), or for another model (when assigned).
        """
        values = read_store(store)
        check_store(values, self.core.cycle.code, self.core.settings.reduction)
        waiting = self._held is not None
        self._held = values
        if not waiting:
            self.core.when_built(self._load_held)

    def _load_held(self) -> None:
        values, self._held = self._held, None
        core = self.core
        # Every check first: a refused store writes nothing.
        check_model(values, core.state)
        untracked = [k for k in values if k.startswith(UNTRACKED)]
        targets = self.family.untracked_variables() if untracked else []
        if len(targets) != len(untracked):
            raise ValueError(
                f"The file holds {len(untracked)} optimizer variables that the wrapped "
                f"optimizer does not list in `variables`, but this one has {len(targets)}: "
                "it was saved from another optimizer or wrapping (a LossScaleOptimizer around it or not)."
            )
        self.optimizer.load_own_variables({k: v for k, v in values.items() if not owns_key(k)})
        for k, v in enumerate(targets):
            v.assign(np.asarray(values[f"{UNTRACKED}{k}"]))
        if f"{KEY}n" in values:
            restore(core.state, core.backend, values, core.settings.sparse)
        core.resync()


def config_of(proxy: Any) -> dict[str, Any]:
    """What `serialize_keras_object` writes for an accumulating optimizer."""
    from keras.src.saving import serialization_lib

    config = proxy._self_core.settings.replace(n=proxy.n).to_config()
    chosen = _auto_size.size_of(proxy._self_core)
    if config["micro_batch_size"] == "auto" and chosen != "auto":
        # The size `"auto"` chose: a loaded optimizer starts from it.
        config[_CHOSEN] = chosen
    config["optimizer"] = serialization_lib.serialize_keras_object(proxy.__wrapped__)
    return {"module": "gradaccum", "class_name": "AccumulatingOptimizer", "config": config,
            "registered_name": REGISTERED_NAME}


def serialize(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `serialize_keras_object`, writing an accumulating optimizer as
    itself: Keras serializes by `__class__`, which a proxy reports as the
    wrapped optimizer's."""
    obj = args[0] if args else kwargs.get("obj")
    if getattr(type(obj), "_gradaccum_registered", False):
        return config_of(obj)
    return wrapped(*args, **kwargs)


def register(cls: type) -> None:
    """Registers `cls` with Keras under `REGISTERED_NAME`, so that
    `load_model` finds it once gradaccum is imported (`safe_mode` too)."""
    from keras.src.saving import object_registration

    object_registration.GLOBAL_CUSTOM_OBJECTS[REGISTERED_NAME] = cls
    object_registration.GLOBAL_CUSTOM_NAMES[cls] = REGISTERED_NAME
    cls._gradaccum_registered = True


def _from_config(config: dict[str, Any], custom_objects: Any = None) -> tuple[Any, Settings]:
    """The wrapped optimizer and the settings of a config `config_of` wrote.

    Raises:
        ValueError: If `config` lacks `optimizer` or `n`.
    """
    missing = sorted({"optimizer", "n"} - set(config))
    if missing:
        raise ValueError(f"An AccumulatingOptimizer config needs {missing}. Received keys: {sorted(config)}.")
    settings = {k: v for k, v in config.items() if k not in ("optimizer", _CHOSEN)}
    optimizer = keras.saving.deserialize_keras_object(config["optimizer"], custom_objects=custom_objects)
    return optimizer, Settings.from_config(settings, custom_objects)


def _copy_of(proxy: Any, copy: Callable[[Any], Any]) -> tuple[Any, Settings, Any]:
    """The arguments of a copy of `proxy`: `copy` of the wrapped optimizer,
    the settings with the current `n`, and the size `"auto"` chose (or None)."""
    chosen = _auto_size.size_of(proxy._self_core)
    chosen = chosen if isinstance(chosen, int) and proxy._self_core.settings.micro_batch_size == "auto" else None
    return copy(proxy.__wrapped__), proxy._self_core.settings.replace(n=proxy.n).portable(), chosen


def _rebuilt(cls: type, optimizer: Any, settings: Settings, chosen: Any = None) -> Any:
    rebuilt = cls._create(optimizer, settings, adopt=True)
    _auto_size.restore(rebuilt._self_core, chosen)
    return rebuilt


class Persistent:
    """How an accumulating optimizer persists (a base of `AccumulatingOptimizer`).

    Keras files and TensorFlow checkpoints reach its runner's state
    (`Saved`, or the loss-scale optimizer's own); a config is written by
    `config_of`. `wrapt.ObjectProxy` refuses to be pickled or copied; a
    Keras optimizer pickles through its `.keras` serialization, and copies go
    the same way: a pickle or copy of an accumulating optimizer is a new one
    with the same settings around what Keras makes of the wrapped optimizer.
    """

    def save_own_variables(self, store: Any) -> None:
        """Saves the wrapped optimizer's variables and the accumulation state.

        Args:
            store: The Keras weights store to write to.
        """
        self._self_runner.save(store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` wrote, now or once built.

        An unbuilt optimizer (a model compiled but not trained yet, as
        `load_model` meets it) keeps the values and assigns them once it is
        built, so a run resumed that way continues exactly where it stopped.
        A store written by the plain optimizer loads into the wrapped one and
        leaves the accumulators empty.

        Args:
            store: The Keras weights store to read from.

        Raises:
            ValueError: If the store was written with another `n` or
                `reduction` (at once), or for another model (when assigned).
        """
        self._self_runner.load(store)

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        return self._self_runner.children(save_type, **kwargs)

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        return self._self_runner.lookup(name, cached_dependencies)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """Re-creates an accumulating optimizer from its serialized config.

        Args:
            config: The `"config"` of what `keras.saving.serialize_keras_object`
                writes for it: the wrapped optimizer's serialized config and
                the settings.
            custom_objects: Passed on to Keras's deserialization.

        Returns:
            A new accumulating optimizer around a new wrapped optimizer.

        Raises:
            ValueError: If `config` lacks `optimizer` or `n`.
        """
        optimizer, settings = _from_config(config, custom_objects)
        created = cls._create(optimizer, settings, adopt=True)
        _auto_size.restore(created._self_core, config.get(_CHOSEN))
        return created

    # `wrapt.ObjectProxy` refuses to be pickled or copied. A Keras optimizer
    # pickles through its `.keras` serialization, and copies go the same
    # way; a proxy's copy is a new proxy with the same settings around what
    # Keras makes of the wrapped optimizer.

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return (_rebuilt, (type(self), *_copy_of(self, lambda optimizer: optimizer)))

    def __reduce__(self) -> tuple:
        return self.__reduce_ex__(2)

    def __copy__(self) -> Any:
        return _rebuilt(type(self), *_copy_of(self, copy.copy))

    def __deepcopy__(self, memo: dict) -> Any:
        return _rebuilt(type(self), *_copy_of(self, lambda optimizer: copy.deepcopy(optimizer, memo)))
