"""Every change gradaccum makes to objects it does not own, in one place.

Importing gradaccum changes nothing. The table below lists every patch; each
is installed on first use, with wrapt's helpers (`resolve_path`,
`apply_patch`, `FunctionWrapper`; a Python function where `torch.compile`
must see the wrapper, see `Patch`), and undone the same way (`Patch.remove`):

- `ACCUMULATE`, on the first call of `accumulate()` or when the first
  accumulating optimizer is made (a proxy's constructor, `from_config`, a
  copy or a pickle): Keras's `Trainer.compute_loss`, to hand each
  micro-batch's loss count to its optimizer (`gradaccum._loss_counts`);
  `LossScaleOptimizer.load_own_variables`, so that one around an
  accumulating optimizer keeps a file loaded before its build, and its
  `apply_gradients` and `apply`, which then take the micro-batch's `weight=`
  (`gradaccum._loss_scale`); the `train_step` of Keras's TensorFlow, JAX and
  PyTorch trainers, which an optimizer with a `micro_batch_size` splits into
  micro-batches, and their `make_train_function`, whose function runs a batch
  again smaller where `micro_batch_size="auto"` runs out of memory
  (`gradaccum._micro_batches`); `keras.optimizers.get`, which refuses
  `accumulate(n=...)` given where an optimizer belongs with gradaccum's own
  error (`gradaccum._api`); Keras's `load_weights_only`, which refuses a
  file the model's accumulating optimizer cannot take before it writes any
  weight, and `Optimizer.load_own_variables`, so that a plain optimizer
  loads its variables from an accumulating one's file
  (`gradaccum._persistence.keras_files`); on TensorFlow,
  `tf.train.Checkpoint.read`, which refuses such a checkpoint before it
  restores anything (`gradaccum._persistence.checkpoint`); on JAX, `JAXTrainer.train_step`, which computes
  the gradients per device where the accumulators are device-local
  (`gradaccum._data_parallel`); and `serialize_keras_object` in every Keras
  module that binds it, so that an accumulating optimizer is written as
  itself (`gradaccum._persistence`).
- `LAYERS`, when `gradaccum.layers` is imported: Keras's `Trainer.compile`
  and `TensorFlowTrainer.make_train_function`, so that a model's
  `gradaccum.layers.BatchNormalization` layers follow its optimizer's
  cycle, and the `__new__` of Keras's `BatchNormalization`, which creates
  gradaccum's layer instead only inside
  `accumulating(..., batch_normalization=True)` (`gradaccum._batch_norm`).
- `SHARED`, installed only while some code holds them (`shared(name)`):
  `Model.compile` and `fit` of Keras 3 and of tf_keras (once imported)
  inside an `accumulating()` block (`gradaccum._accumulating`); `Loss.__call__`
  and `reduce_weighted_values` while a loss count is recorded
  (`gradaccum._loss_counts`).
- Not in the table, being per object: the write methods of the TensorFlow
  variables an update writes, and a Keras 3 optimizer's `update_step`,
  for the duration of one masked update
  (`gradaccum._backend.tensorflow.updates`).

Where a patch's target or wrapper is named as `"module:attribute"`, it is
imported when the patch is installed, so that this module imports nothing.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import wrapt

# The signature of a wrapt wrapper: (wrapped, instance, args, kwargs).
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]

_MISSING = object()


class Spec(NamedTuple):
    """One patch: `target.name` wrapped by `wrapper` (both `"module:path"`).

    `static=True` for `__new__`, which Python looks up as a static method.
    `module` names a library users import themselves (tf_keras): the patch
    is installed only once it is imported, never by importing it.
    `traced=True` for a method that `torch.compile` traces (Keras's
    `compute_loss`, inside a compiled train step): see `Patch`.
    """

    target: str
    name: str
    wrapper: str
    static: bool = False
    module: str | None = None
    traced: bool = False


_SAVING = "keras.src.saving.serialization_lib"
ACCUMULATE = (
    Spec("keras.src.trainers.trainer:Trainer", "compute_loss", "gradaccum._loss_counts:compute_loss", traced=True),
    Spec("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer", "load_own_variables",
         "gradaccum._loss_scale:load_when_built"),
    Spec("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer", "apply_gradients",
         "gradaccum._loss_scale:weighted"),
    Spec("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer", "apply", "gradaccum._loss_scale:weighted"),
    Spec("keras.src.optimizers:", "get", "gradaccum._api:optimizer_get"),
    Spec("keras.src.saving.saving_lib:", "load_weights_only",
         "gradaccum._persistence.keras_files:check_before_loading"),
    Spec("keras.src.optimizers.base_optimizer:BaseOptimizer", "load_own_variables",
         "gradaccum._persistence.keras_files:load_into_plain"),
    Spec("tensorflow.python.checkpoint.checkpoint:Checkpoint", "read",
         "gradaccum._persistence.checkpoint:read_checked"),
    Spec("keras.src.backend.jax.trainer:JAXTrainer", "train_step", "gradaccum._data_parallel:train_step"),
    # After the data-parallel hook, so that each micro-batch's step runs it.
    Spec("keras.src.backend.jax.trainer:JAXTrainer", "train_step", "gradaccum._micro_batches:train_step"),
    Spec("keras.src.backend.tensorflow.trainer:TensorFlowTrainer", "train_step",
         "gradaccum._micro_batches:train_step"),
    Spec("keras.src.backend.jax.trainer:JAXTrainer", "make_train_function",
         "gradaccum._micro_batches:make_train_function"),
    Spec("keras.src.backend.tensorflow.trainer:TensorFlowTrainer", "make_train_function",
         "gradaccum._micro_batches:make_train_function"),
    Spec("keras.src.backend.torch.trainer:TorchTrainer", "make_train_function",
         "gradaccum._micro_batches:make_train_function"),
    Spec("keras.src.backend.torch.trainer:TorchTrainer", "train_step", "gradaccum._micro_batches:train_step",
         traced=True),
    Spec(f"{_SAVING}:", "serialize_keras_object", "gradaccum._persistence:serialize"),
    Spec("keras.src.saving.saving_lib:", "serialize_keras_object", "gradaccum._persistence:serialize"),
    Spec("keras.src.saving:", "serialize_keras_object", "gradaccum._persistence:serialize"),
    Spec("keras.saving:", "serialize_keras_object", "gradaccum._persistence:serialize"),
    Spec("keras.utils:", "serialize_keras_object", "gradaccum._persistence:serialize"),
)
LAYERS = (
    Spec("keras.src.trainers.trainer:Trainer", "compile", "gradaccum._batch_norm:after_compile"),
    Spec("keras.src.backend.tensorflow.trainer:TensorFlowTrainer", "make_train_function",
         "gradaccum._batch_norm:before_train_function"),
    Spec("keras.src.layers.normalization.batch_normalization:BatchNormalization", "__new__",
         "gradaccum._batch_norm:new", static=True),
)
SHARED = {
    "keras.compile": Spec("keras:Model", "compile", "gradaccum._accumulating:compile_keras"),
    "keras.fit": Spec("keras:Model", "fit", "gradaccum._accumulating:fit"),
    "tf_keras.compile": Spec("tf_keras:Model", "compile", "gradaccum._accumulating:compile_tf_keras",
                             module="tf_keras"),
    "tf_keras.fit": Spec("tf_keras:Model", "fit", "gradaccum._accumulating:fit", module="tf_keras"),
    "loss.call": Spec("keras.src.losses.loss:Loss", "__call__", "gradaccum._loss_counts:loss_call"),
    "loss.reduce": Spec("keras.src.losses.loss:", "reduce_weighted_values", "gradaccum._loss_counts:reduce"),
}


def _resolve(reference: str) -> Any:
    module, _, path = reference.partition(":")
    found = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        found = getattr(found, part)
    return found


class Patch:
    """`target.name` replaced by a `wrapt.FunctionWrapper` around it.

    `target` is a module, a class or an instance. On a class, the attribute
    is set on that class even where a base class defines it; on an instance,
    it shadows the class's method. `remove()` puts back exactly what was
    there: the attribute the object itself held, or none.

    Args:
        target: The object whose attribute is replaced.
        name: The attribute's name.
        wrapper: Called as `wrapper(wrapped, instance, args, kwargs)`.
        static: Whether the attribute is set as a static method (`__new__`).
        traced: For a method of a class: set a Python function that calls
            `wrapper` instead. `torch.compile` takes a `wrapt.FunctionWrapper`
            for the function it wraps (the proxy answers `isinstance` and
            `__code__` for it) and traces that, skipping the wrapper; it
            follows a Python function.
    """

    def __init__(self, target: Any, name: str, wrapper: Wrapper, static: bool = False, traced: bool = False):
        parent, attribute, original = wrapt.resolve_path(target, name)
        self._parent = parent
        self._attribute = attribute
        self._own = vars(parent).get(attribute, _MISSING)
        self.original = original
        replacement: Any = _method(original, wrapper) if traced else wrapt.FunctionWrapper(original, wrapper)
        wrapt.apply_patch(parent, attribute, staticmethod(replacement) if static else replacement)

    @classmethod
    def of(cls, spec: Spec) -> Patch:
        """The patch a `Spec` describes, installed."""
        return cls(_resolve(spec.target), spec.name, _resolve(spec.wrapper), spec.static, spec.traced)

    def remove(self) -> None:
        """Restores the attribute as it was before the patch."""
        if self._own is _MISSING:
            delattr(self._parent, self._attribute)
        else:
            setattr(self._parent, self._attribute, self._own)


def _method(original: Callable[..., Any], wrapper: Wrapper) -> Callable[..., Any]:
    """A method calling `wrapper` as `wrapt.FunctionWrapper` does."""

    @functools.wraps(original)
    def method(instance: Any, *args: Any, **kwargs: Any) -> Any:
        # A partial, not a bound method: `torch.compile`, resuming after a
        # graph break, would look a bound method up again by its name.
        return wrapper(functools.partial(original, instance), instance, args, kwargs)

    return method


# The backends whose trainers the patches may target.
_TRAINERS = ("tensorflow", "jax", "torch")
_installed: dict[str, list[Patch]] = {}
_lock = threading.Lock()


def install(group: str = "accumulate") -> None:
    """Installs the patches of `ACCUMULATE` (or `"layers"`: `LAYERS`), once.

    A patch of the TensorFlow, JAX or PyTorch trainer is left out on other backends.
    """
    with _lock:
        if group in _installed:
            return
        import keras

        backend = keras.config.backend()
        if backend not in _TRAINERS:
            # Nothing of gradaccum runs there (its caller raises): installing
            # now would leave out the patches of the backend that trains later.
            return
        specs = for_backend(ACCUMULATE if group == "accumulate" else LAYERS, backend)
        _installed[group] = [Patch.of(spec) for spec in specs]


def for_backend(specs: tuple[Spec, ...], backend: str) -> tuple[Spec, ...]:
    """`specs` without the patches of another backend's trainer or library
    (whose module would import that backend)."""
    others = [b for b in _TRAINERS if b != backend]
    return tuple(s for s in specs if not any(f".{b}." in f".{s.target}" for b in others))


class SharedPatch:
    """A patch installed while at least one user holds it (thread-safe).

    Args:
        spec: The patch. With `spec.module`, it is installed only while that
            module is imported, also if it is imported while users hold the
            patch (a wrapt post-import hook), never by importing it.
    """

    def __init__(self, spec: Spec):
        self._spec = spec
        self._lock = threading.Lock()
        self._patch: Patch | None = None
        self._users = 0
        if spec.module is not None:
            wrapt.register_post_import_hook(self._imported, spec.module)

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
        module = self._spec.module
        if self._patch is None and (module is None or module in sys.modules):
            self._patch = Patch.of(self._spec)

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


_shared: dict[str, SharedPatch] = {}


def shared(name: str) -> SharedPatch:
    """The shared patch `SHARED[name]` (made once, installed while held)."""
    with _lock:
        if name not in _shared:
            _shared[name] = SharedPatch(SHARED[name])
        return _shared[name]
