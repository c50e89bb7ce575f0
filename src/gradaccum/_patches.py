"""Every change gradaccum makes to objects it does not own, in one place.

The patches, all made with wrapt's helpers (`resolve_path`, `apply_patch`,
`FunctionWrapper`), all undone the same way (`Patch.remove`):

- `keras.Model.compile` and `fit` (and tf_keras's, once tf_keras is
  imported), while a `gradaccum.accumulating()` block is open in any thread
  (`SharedPatch`; see `gradaccum._accumulating`);
- Keras's `serialize_keras_object`, for good, in every Keras module that
  binds it, so that a proxy is written as itself (`serialize_as`);
- Keras's `LossScaleOptimizer.load_own_variables`, for good, so that one
  around an accumulating optimizer keeps a file loaded before its build
  (see `gradaccum._loss_scale`);
- the write methods of TensorFlow variables, and a Keras 3 optimizer's
  `update_step`, for the duration of one masked update (see
  `gradaccum._backend.tensorflow.updates`);
- Keras's `Trainer.compute_loss`, for good, and, while it computes the loss
  of a model whose optimizer accumulates, `Loss.__call__` and Keras's
  `reduce_weighted_values` (`SharedPatch`), to record what each loss divides
  its micro-batch by (see `gradaccum._loss_counts`);
- Keras's `Trainer.compile` and `TensorFlowTrainer.make_train_function`, for
  good, so that a model's `gradaccum.layers.BatchNormalization` layers
  follow its optimizer's cycle, and the `__new__` of Keras's
  `BatchNormalization`, for good, which creates gradaccum's layer instead
  only inside `gradaccum.accumulating(..., batch_normalization=True)` (see
  `gradaccum._batch_norm`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import wrapt

# The signature of a wrapt wrapper: (wrapped, instance, args, kwargs).
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]

_MISSING = object()


class Patch:
    """`target.name` replaced by a `wrapt.FunctionWrapper` around it.

    `target` is a module, a class or an instance. On a class, the attribute
    is set on that class even where a base class defines it (the wrapper
    then reaches the base's function); on an instance, it shadows the
    class's method. `remove()` puts back exactly what was there: the
    attribute the object itself held, or none.

    Args:
        target: The object whose attribute is replaced.
        name: The attribute's name.
        wrapper: Called as `wrapper(wrapped, instance, args, kwargs)`.
    """

    def __init__(self, target: Any, name: str, wrapper: Wrapper):
        parent, attribute, original = wrapt.resolve_path(target, name)
        self._parent = parent
        self._attribute = attribute
        self._own = vars(parent).get(attribute, _MISSING)
        self.original = original
        wrapt.apply_patch(parent, attribute, wrapt.FunctionWrapper(original, wrapper))

    def remove(self) -> None:
        """Restores the attribute as it was before the patch."""
        if self._own is _MISSING:
            delattr(self._parent, self._attribute)
        else:
            setattr(self._parent, self._attribute, self._own)


class SharedPatch:
    """A `Patch` installed while at least one user holds it (thread-safe).

    Args:
        target: See `Patch`; resolved when the patch is installed.
        name: See `Patch`.
        wrapper: See `Patch`.
        module: The module `target` belongs to, if it is one that is not
            imported here (tf_keras): the patch is installed only while that
            module is imported, also if it is imported while users hold the
            patch (a wrapt post-import hook), never by importing it.
    """

    def __init__(self, target: Callable[[], Any], name: str, wrapper: Wrapper, module: str | None = None):
        self._target = target
        self._name = name
        self._wrapper = wrapper
        self._module = module
        self._lock = threading.Lock()
        self._patch: Patch | None = None
        self._users = 0
        if module is not None:
            wrapt.register_post_import_hook(self._imported, module)

    @property
    def installed(self) -> bool:
        """Whether the patch is in place now."""
        return self._patch is not None

    @property
    def original(self) -> Any:
        """The patched function; only while installed."""
        assert self._patch is not None
        return self._patch.original

    def _install(self) -> None:
        if self._patch is None and (self._module is None or self._module in sys.modules):
            self._patch = Patch(self._target(), self._name, self._wrapper)

    def _imported(self, module: Any) -> None:
        with self._lock:
            if self._users:
                self._install()

    def acquire(self) -> None:
        with self._lock:
            self._install()
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._patch is not None:
                self._patch.remove()
                self._patch = None


def serialize_as(cls: type, serialized: Callable[[Any], dict]) -> None:
    """Makes Keras's `serialize_keras_object` write instances of `cls` with
    `serialized(obj)`, everywhere Keras binds that function (once).

    Keras serializes an object by its `__class__`, which a proxy reports as
    the wrapped object's; the real type says what the object is.
    """
    from keras.src.saving import serialization_lib

    original = serialization_lib.serialize_keras_object
    if getattr(original, "_gradaccum_serializes", None) is not None:
        return

    def serialize(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        obj = args[0] if args else kwargs.get("obj")
        if issubclass(type(obj), cls):
            return serialized(obj)
        return wrapped(*args, **kwargs)

    # The function is bound by name in a few public modules too.
    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(
            module, "serialize_keras_object", None
        ) is original:
            Patch(module, "serialize_keras_object", serialize)
    serialization_lib.serialize_keras_object._gradaccum_serializes = cls
