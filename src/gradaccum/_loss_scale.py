"""Loss scaling: accumulate inside a loss-scale optimizer, never around it.

`accumulate(LossScaleOptimizer(opt), n)` must not accumulate around the
loss-scale optimizer: its gradients are still scaled, and a step it skips for
non-finite gradients would still count as a micro-step. Instead the
loss-scale optimizer keeps its job (scale the loss, unscale the gradients,
drop a non-finite micro-batch and halve the scale) and its inner optimizer is
replaced by an accumulating one, which therefore only ever sees unscaled,
finite micro-gradients. A dropped micro-batch is neither added nor counted:
the cycle waits for `n` finite micro-batches, and those already accumulated
are kept. The accumulating optimizer `accumulate` returns is the loss-scale
optimizer to everyone else (`LossScaled` is how it runs).

`LossScaleOptimizer(accumulate(opt, n))` (also what `model.compile` builds
under a `mixed_float16` policy) needs nothing from here to accumulate: the
loss-scale optimizer calls the accumulating one only for finite
micro-batches. Only a Keras file loaded into it before it is built needs
help (`load_when_built`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import wrapt

from gradaccum import _backend, _families
from gradaccum._persistence.keras_files import read_store
from gradaccum._settings import Settings


class _UncountedIterations(wrapt.ObjectProxy):
    """`iterations` whose `assign_add` does nothing (see `_UncountedSkips`)."""

    def assign_add(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        if read_value:
            return self.__wrapped__.read_value()
        return _backend.for_active().gradients.no_op()


class _UncountedSkips(wrapt.ObjectProxy):
    """The accumulating optimizer as seen by a loss-scale optimizer that
    counts its skips: tf_keras's adds a step it skips for non-finite
    gradients to its inner optimizer's `iterations`; through this proxy that
    write does nothing, so a dropped micro-batch leaves `iterations` as it
    was. Everything else reaches the accumulating optimizer."""

    @property
    def iterations(self) -> Any:
        return _UncountedIterations(self.__wrapped__.iterations)


class LossScaled:
    """How an accumulating optimizer runs around a loss-scale optimizer.

    Args:
        optimizer: The loss-scale optimizer.
        settings: The accumulation's settings.
        adopt: Deserializing: if the loss-scale optimizer's inner optimizer
            accumulates already, it is the one to use (it was saved as one).
        accumulating: Makes an accumulating optimizer around an optimizer.
    """

    def __init__(self, optimizer: Any, settings: Settings, adopt: bool, accumulating: Callable[[Any, Settings], Any]):
        family = _families.family_of(optimizer)
        attribute = family.inner_attribute()
        inner = getattr(optimizer, attribute)
        if not (adopt and _families.accumulates(inner)):
            family = _families.wrappable(optimizer)
            inner = accumulating(inner, settings)
            _install(optimizer, attribute, inner)
        self.optimizer = optimizer
        self.family = family
        self.inner = inner
        self.attribute = attribute
        self.core = inner._self_core

    @classmethod
    def handles(cls, optimizer: Any) -> bool:
        """Whether `optimizer` is a loss-scale optimizer."""
        family = _families.family_of(optimizer)
        return family is not None and family.inner_attribute() is not None

    @contextlib.contextmanager
    def _skips_uncounted(self) -> Iterator[None]:
        """While the loss-scale optimizer runs, it sees the accumulating
        optimizer through `_UncountedSkips`, if it would count skipped steps
        in its inner optimizer's `iterations`."""
        if not self.family.skips_count_in_inner:
            yield
            return
        # Plain attribute writes: the loss-scale optimizer's checkpoint
        # dependencies are its original inner optimizer's, set at creation.
        object.__setattr__(self.optimizer, self.attribute, _UncountedSkips(self.inner))
        try:
            yield
        finally:
            object.__setattr__(self.optimizer, self.attribute, self.inner)

    def build(self, variables: Sequence[Any]) -> None:
        # The loss-scale optimizer's own `build` if it has one (a tf_keras
        # OptimizerV2 has none): it builds the inner one and its own state.
        build = getattr(self.optimizer, "build", None) or self.inner.build
        build(list(variables))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any, **kwargs: Any) -> Any:
        with self.core.weights.weighing(weight), self._skips_uncounted():
            return self.optimizer.apply_gradients(grads_and_vars, **kwargs)

    def apply(self, grads: Sequence[Any], variables: Sequence[Any] | None, weight: Any) -> Any:
        with self.core.weights.weighing(weight):
            return self.optimizer.apply(grads, variables)

    @property
    def variables(self) -> Any:
        return self.optimizer.variables

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any], weight: Any) -> Any:
        with self.core.weights.weighing(weight):
            return self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)

    # Keras files: the loss-scale optimizer's own variables (its scale and
    # step counter, then its inner optimizer's) are written under its path;
    # the inner accumulating optimizer writes the accumulation state under
    # its own. Loaded before the build, both wait for it (`load_when_built`).

    def save(self, store: Any) -> None:
        # A tf_keras OptimizerV2 has no Keras-file methods.
        save = getattr(self.optimizer, "save_own_variables", None)
        if save is not None:
            save(store)

    def load(self, store: Any) -> None:
        load = getattr(self.optimizer, "load_own_variables", None)
        if load is not None:
            load(store)

    def children(self, save_type: str, **kwargs: Any) -> dict[str, Any]:
        return self.optimizer._trackable_children(save_type, **kwargs)

    def lookup(self, name: str, cached_dependencies: Any = None) -> Any:
        return self.optimizer._lookup_dependency(name, cached_dependencies)


def _install(optimizer: Any, attribute: str, inner: Any) -> None:
    """Makes `inner` the loss-scale optimizer's inner optimizer."""
    setattr(optimizer, attribute, inner)
    # tf_keras's loss-scale optimizer for OptimizerV2 hands every checkpoint
    # call to the inner optimizer it was created with; point it at the
    # accumulating one, or checkpoints would miss its state.
    _backend.for_active().gradients.delegate_tracking(optimizer, inner)


def load_when_built(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `LossScaleOptimizer.load_own_variables`, deferred like the
    accumulating optimizer's.

    Unbuilt, Keras's loss-scale optimizer drops its saved variables (its
    scale, its step counter and its inner optimizer's) with a warning. Around
    an accumulating optimizer, which keeps its own part for its build, that
    would resume with a reset loss scale; so the values wait for the inner
    one's build, which runs inside the loss-scale optimizer's `build` after
    its own variables exist. Any other loss-scale optimizer loads as Keras
    does.
    """
    inner = getattr(instance, "inner_optimizer", None)
    if instance is None or instance.built or not _families.accumulates(inner):
        return wrapped(*args, **kwargs)
    values = read_store(args[0] if args else kwargs["store"])
    inner._self_core.when_built(lambda: wrapped(values))
    return None


def weighted(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `LossScaleOptimizer.apply_gradients` and `apply`, taking the
    micro-batch's `weight=` when the loss-scale optimizer wraps an
    accumulating one (as `compile` wraps it under `mixed_float16`): the
    weight goes to the accumulating optimizer's next micro-step, as
    `AccumulatingOptimizer.apply_gradients(..., weight=w)` hands it.

    Raises:
        TypeError: For `weight=` where the inner optimizer does not accumulate.
    """
    if "weight" not in kwargs:
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    weight = kwargs.pop("weight")
    core = _families.core_in(getattr(instance, "inner_optimizer", None))
    if core is None:
        raise TypeError(
            f"{wrapped.__name__}() got an unexpected keyword argument 'weight': a loss-scale "
            "optimizer takes `weight=` only around an accumulating optimizer (gradaccum.accumulate)."
        )
    with core.weights.weighing(weight):
        return wrapped(*args, **kwargs)
