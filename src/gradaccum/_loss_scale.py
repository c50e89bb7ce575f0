"""Loss scaling: accumulate inside a loss-scale optimizer, never around it.

`accumulate(LossScaleOptimizer(opt), n)` must not accumulate around the
loss-scale optimizer: its gradients are still scaled, and a step it skips for
non-finite gradients would still count as a micro-step. Instead the
loss-scale optimizer keeps its job (scale the loss, unscale the gradients,
drop a non-finite micro-batch and halve the scale) and its inner optimizer is
replaced by an accumulating core, which therefore only ever sees unscaled,
finite micro-gradients. A dropped micro-batch is neither added nor counted:
the cycle waits for `n` finite micro-batches, and those already accumulated
are kept. What `accumulate` returns is a `LossScaleFront`: the loss-scale
optimizer to everyone else, with the accumulating surface of its core.

`LossScaleOptimizer(accumulate(opt, n))` (also what `model.compile` builds
under a `mixed_float16` policy) needs nothing from here to accumulate: the
loss-scale optimizer calls the accumulating one only for finite
micro-batches. Only a Keras file loaded into it before it is built needs
help (`_load_when_built`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import keras
import numpy as np
import wrapt

from gradaccum import _families, _patches
from gradaccum._proxy import AccumulatingOptimizer, accumulation_of, register_kind, wrappable_family
from gradaccum._store import read_store
from gradaccum._validation import check_mode, check_n_or_schedule, check_reduction, check_sparse, check_weigh_by

if TYPE_CHECKING:
    import tensorflow as tf


class _UncountedIterations(wrapt.ObjectProxy):
    """`iterations` whose `assign_add` does nothing (see `_UncountedSkips`)."""

    def assign_add(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        if read_value:
            return self.__wrapped__.read_value()
        import tensorflow as tf  # tf_keras only

        return tf.no_op()


class _UncountedSkips(wrapt.ObjectProxy):
    """The core as seen by a loss-scale optimizer that counts its skips.

    The only write such a loss-scale optimizer (tf_keras's) makes to its
    inner optimizer is `inner.iterations.assign_add(1)` when it skips a step
    for non-finite gradients. Seen through this proxy that write does
    nothing, so a dropped micro-batch leaves `iterations` as it was;
    everything else reaches the core.
    """

    @property
    def iterations(self) -> Any:
        return _UncountedIterations(self.__wrapped__.iterations)


@register_kind
class LossScaleFront(AccumulatingOptimizer):
    """The kind that wraps a loss-scale optimizer (see the module docstring).

    Args:
        optimizer: The loss-scale optimizer.
        n, reduction, mode, weigh_by, sparse, agc: As for `AccumulatingOptimizer`.
        _adopt: Deserializing: the loss-scale optimizer's inner optimizer,
            if it accumulates already, is the core (it was saved as one).
    """

    @classmethod
    def _handles(cls, optimizer: Any) -> bool:
        family = _families.family_of(optimizer)
        return family is not None and family.inner_attribute() is not None

    def __init__(
        self,
        optimizer: Any,
        n: int | Callable[[tf.Tensor], Any],
        reduction: str = "mean",
        mode: str = "masked",
        weigh_by: str = "count",
        sparse: str = "rows",
        *,
        agc: Any = None,
        _adopt: bool = False,
    ):
        family = _families.family_of(optimizer)
        attribute = family.inner_attribute()
        core = getattr(optimizer, attribute)
        if not (_adopt and isinstance(core, AccumulatingOptimizer)):
            family = wrappable_family(optimizer)
            n, reduction, mode = check_n_or_schedule(n), check_reduction(reduction), check_mode(mode)
            core = AccumulatingOptimizer(
                core, n, reduction=reduction, mode=mode, weigh_by=check_weigh_by(weigh_by),
                sparse=check_sparse(sparse), agc=agc,
            )
            self._install(optimizer, attribute, core)
        super().__init__(optimizer, family, accumulation_of(core))
        self._self_core = core
        self._self_inner_attribute = attribute

    @staticmethod
    def _install(optimizer: Any, attribute: str, core: AccumulatingOptimizer) -> None:
        """Makes `core` the loss-scale optimizer's inner optimizer."""
        setattr(optimizer, attribute, core)
        if keras.config.backend() != "tensorflow":
            return
        import tensorflow as tf

        delegating = tf.__internal__.tracking.DelegatingTrackableMixin
        if isinstance(optimizer, delegating):
            # tf_keras's loss-scale optimizer for OptimizerV2 hands every
            # checkpoint call to the inner optimizer it was created with;
            # point it at the core, or checkpoints would miss the
            # accumulation state.
            delegating.__init__(optimizer, core)

    @contextlib.contextmanager
    def _skips_uncounted(self) -> Iterator[None]:
        """While the loss-scale optimizer runs, it sees the core through
        `_UncountedSkips`, if it would count skipped steps in the core's
        `iterations`."""
        if not self._self_family.skips_count_in_inner:
            yield
            return
        lso, attribute, core = self.__wrapped__, self._self_inner_attribute, self._self_core
        # Plain attribute writes: the loss-scale optimizer's checkpoint
        # dependencies are its original inner optimizer's, set at creation.
        object.__setattr__(lso, attribute, _UncountedSkips(core))
        try:
            yield
        finally:
            object.__setattr__(lso, attribute, core)

    # Keras files: the loss-scale optimizer's own variables (its scale and
    # step counter, then its inner optimizer's) are written under its path;
    # the core writes the accumulation state under the inner optimizer's.
    # Loaded before the build, both wait for it (see `load_own_variables`):
    # the core's state is built inside the loss-scale optimizer's `build`,
    # after the latter's own variables.

    def _save_now(self, store: Any) -> None:
        # A tf_keras OptimizerV2 has no Keras-file methods.
        save = getattr(self.__wrapped__, "save_own_variables", None)
        if save is not None:
            save(store)

    def _load_now(self, values: dict[str, np.ndarray]) -> None:
        load = getattr(self.__wrapped__, "load_own_variables", None)
        if load is not None:
            load(values)

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the loss-scale optimizer and the core.

        Args:
            variables: The trainable variables the optimizer will update.
        """
        # The loss-scale optimizer's own `build` if it has one (a tf_keras
        # OptimizerV2 has none): it builds the core and its own state.
        build = getattr(self.__wrapped__, "build", None) or self._self_core.build
        build(list(variables))

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any = None, **kwargs: Any
    ) -> Any:
        """The loss-scale optimizer's `apply_gradients`, accumulating inside.

        Args:
            grads_and_vars: `(gradient, variable)` pairs of scaled gradients.
            weight: Optional weight of this micro-batch; see
                `AccumulatingOptimizer.apply_gradients`.
            **kwargs: The loss-scale optimizer's further arguments.

        Returns:
            What the loss-scale optimizer's `apply_gradients` returns.
        """
        with self._self_accumulation.weighing(weight), self._skips_uncounted():
            return self.__wrapped__.apply_gradients(grads_and_vars, **kwargs)

    def apply(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None, weight: Any = None
    ) -> Any:
        """The loss-scale optimizer's `apply`, accumulating inside.

        Args:
            grads: One scaled gradient per variable.
            trainable_variables: The variables, in the order of `grads`.
            weight: Optional weight of this micro-batch.

        Returns:
            What the loss-scale optimizer's `apply` returns.
        """
        with self._self_accumulation.weighing(weight):
            return self.__wrapped__.apply(grads, trainable_variables)


def _load_when_built(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `LossScaleOptimizer.load_own_variables`, deferred like the core's.

    Unbuilt, Keras's loss-scale optimizer drops its saved variables (its
    scale, its step counter and its inner optimizer's) with a warning. Around
    an accumulating core, which keeps its own part for its build, that would
    resume with a reset loss scale; so the values wait for the core's build,
    which runs inside the loss-scale optimizer's `build` after its own
    variables exist. Any other loss-scale optimizer loads as Keras does.
    """
    core = getattr(instance, "inner_optimizer", None)
    if instance is None or instance.built or not isinstance(core, AccumulatingOptimizer):
        return wrapped(*args, **kwargs)
    values = read_store(args[0] if args else kwargs["store"])
    accumulation_of(core).when_built(lambda: wrapped(values))
    return None


_patches.Patch(keras.optimizers.LossScaleOptimizer, "load_own_variables", _load_when_built)
