"""The hooks on TensorFlow (Keras 3's TensorFlow backend, and tf_keras).

State lives where `tf.distribute` wants it (`distribution`): each replica
adds its micro-gradients into its own replica-local accumulators, without
communication, and every replica advances the mirrored counters alike. The
update of the step that ends a cycle runs one of two ways (`updates`):

- `"masked"`: the wrapped optimizer's update runs on every micro-step up to
  its merge call (clipping, all-reduce), with no branch around anything
  that synchronises replicas; a Keras 3 optimizer's writes (weight decay,
  `update_step`, moving averages, constraints, `iterations`) run in one
  branch, taken on the apply step. Traced, the accumulators are divided in
  place on the apply step, so the update reads them directly; eagerly,
  into new tensors, so an update that raises leaves the sums.
- `"skip"`: the update runs only on the apply step, decided in
  cross-replica context, so replicas all-reduce once per cycle.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from gradaccum._backend import StateVariables, Update
from gradaccum._backend.tensorflow import distribution, tensors, updates
from gradaccum._backend.tensorflow.kept import Kept


class TensorFlowBackend:
    """The hooks of `gradaccum._backend.Backend` on TensorFlow."""

    counter_dtype = "int64"
    host_counters = False

    # ------------------------------------------------------------------
    # State.

    def create_state(
        self, family: Any, variables: Sequence[Any], n: int | None, dtype: str = "float32"
    ) -> StateVariables:
        accumulators = self.new_accumulators(family, variables, dtype)
        with distribution.creation_scope(family.strategy()):
            touched = None
            if self.masks_each(family):
                touched = distribution.mirrored_counter(tf.ones([len(variables)], tf.int32), name="touched")
            return StateVariables(
                accumulators=accumulators,
                micro_step=distribution.mirrored_counter(0, name="micro_step"),
                weight_total=distribution.replica_local(tf.constant(0.0), name="weight_total"),
                n=None if n is None else distribution.mirrored_counter(n, name="n"),
                touched=touched,
            )

    def masks_each(self, family: Any) -> bool:
        """Whether an update can leave some of its variables untouched at run
        time: for families whose every write is a variable's write method
        and whose per-variable update synchronises nothing (Keras 3)."""
        return family.masks_writes and family.per_variable_update is not None

    def new_accumulators(self, family: Any, variables: Sequence[Any], dtype: str = "float32") -> list[Any]:
        with distribution.creation_scope(family.strategy()):
            return [
                distribution.replica_local(
                    tf.zeros(v.shape, dtype=tensors.accumulator_dtype(v, dtype)),
                    name="accumulator",
                    colocate_with=family.model_variable(v),
                )
                for v in variables
            ]

    def listed(self, state: Any) -> list[Any]:
        # Checkpoints reach the state through the proxy's checkpoint child
        # (`gradaccum._persistence`); the optimizer's `variables` stay Keras's.
        return []

    def check_settings(self, settings: Any) -> None:
        return None

    def check_build(self, family: Any, sparse: str) -> None:
        return None

    # ------------------------------------------------------------------
    # Reading.

    def known(self, value: Any) -> bool:
        return tf.executing_eagerly()

    def read(self, variable: Any) -> Any:
        return variable.value()

    def snapshot(self, variable: Any) -> Any:
        return tf.identity(variable)

    def eagerly(self) -> contextlib.AbstractContextManager[None]:
        return tf.init_scope()

    def writable_now(self, variable: Any) -> bool:
        return tf.executing_eagerly()

    def saved(self, variable: Any, maximum: bool) -> np.ndarray:
        """The value a Keras file holds: a replica-local variable reads as the
        sum of the replicas' copies; a maximum is the maximum of them."""
        if maximum and isinstance(variable, tf.distribute.DistributedValues):
            return np.max([np.asarray(v.numpy()) for v in variable.values], axis=0)
        return np.asarray(variable.numpy())

    def load(self, variable: Any, value: np.ndarray, maximum: bool) -> None:
        """Writes a value `saved` returned: a sum is split among the replicas,
        a maximum is every replica's."""
        variable.assign(value if maximum else distribution.per_replica_share(value))

    # ------------------------------------------------------------------
    # A micro-step.

    def add_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        tensors.add_into(accumulators, grads, weight, first)

    def after(self, grads: Sequence[Any], variables: Sequence[Any], weight: Any
              ) -> contextlib.AbstractContextManager[None]:
        return tensors.after(grads, variables, weight)

    def ordered(self, value: Any) -> Any:
        return value if tf.executing_eagerly() else tf.identity(value)

    def max_into(self, accumulator: Any, value: Any, first: Any) -> None:
        tensors.max_into(accumulator, value, first)

    def add_scalar(self, total: Any, value: Any, first: Any) -> None:
        tensors.add_scalar(total, value, first)

    def scalar_variable(self, family: Any, name: str) -> Any:
        with distribution.creation_scope(family.strategy()):
            return distribution.replica_local(tf.constant(0.0), name=name)

    def squared_norm(self, values: Sequence[Any]) -> Any:
        return tensors.squared_norm(values)

    def add_squared_norm(self, total: Any, values: Sequence[Any], weight: Any, first: Any) -> None:
        square = tensors.squared_norm(values)
        tensors.add_scalar(total, square if weight is None else square * tf.cast(weight, tf.float32), first)

    def zero_if(self, condition: Any, variables: Sequence[Any]) -> None:
        if variables:
            tensors.zero_if(condition, variables)

    def assign(self, variable: Any, value: Any) -> None:
        if tf.executing_eagerly() and distribution.in_replica_context():
            # Each replica writes its own copy, without the merge call a
            # mirrored variable's write makes: a failure in a merge call
            # stops the replicas' later ones, which the restore of the failed
            # step (`gradaccum._atomic`) would wait on for ever. Every replica
            # writes a mirrored counter's same value (`mirrored_counter`).
            variable = distribution.local_copy(variable)
        variable.assign(tf.cast(value, variable.dtype), read_value=False)

    def set_counter(self, variable: Any, value: int) -> None:
        variable.assign(value)

    def finish(self, update: Update, mode: str) -> None:
        if mode == "masked":
            self._masked(update)
        else:
            self._skipped(update)

    def _masked(self, update: Update) -> None:
        values = _quotients(update)
        family = update.family
        conditions = _conditions(update)
        strategy = family.strategy()
        if family.masks_writes and updates.splits(family.optimizer, strategy, bool(conditions)):
            update.apply(values, masking=updates.Masking(update.ends, conditions))
            return
        # A variable without a gradient in the cycle, and its slots, keep
        # their values; the rest of the state moves on the apply step. Every
        # variable the optimizer was built for, not only those in this
        # update: with `ema_overwrite_frequency` Keras overwrites all of them
        # with their moving averages, gradient or not.
        owned = [(v, tf.logical_and(update.ends, c)) for v, c in _owned(update, conditions)]
        tracked = family.state_variables() + [family.model_variable(v) for v in update.variables]
        keep = owned + [(v, update.ends) for v in tracked]
        updates.snapshot_update(strategy, keep, lambda: update.apply(values))

    def _skipped(self, update: Update) -> None:
        # Read here and handed to the branch: a branch that touches a
        # variable waits for every earlier write to it, and under a strategy
        # per-replica values must be the branch's inputs.
        values = _read(update.accumulators)
        divided = update.divided

        def apply(values: list[tf.Tensor], divisor: tf.Tensor | None = None) -> None:
            if divisor is not None:
                values = [v / tf.cast(divisor, v.dtype) if d else v for v, d in zip(values, divided)]
            # Kept slices are divided by this replica's divisor, a branch input.
            if not update.conditions:
                update.apply(values, divisor)
                return
            # Inside the branch the cycle ends: only the conditions remain.
            # Read here, in this replica's own context.
            conditions = _conditions(update)
            family = update.family
            if family.masks_writes and updates.splits(family.optimizer, family.strategy(), True):
                update.apply(values, divisor, masking=updates.Masking(None, conditions))
                return
            owned = _owned(update, conditions)
            if not owned:
                update.apply(values, divisor)
                return
            updates.snapshot_update(family.strategy(), owned, lambda: update.apply(values, divisor))

        inputs = [values] if update.divisor is None else [values, update.divisor]
        updates.skipped_update(update.ends, apply, *inputs)

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        if tf.executing_eagerly():
            if bool(condition):
                fn()
            return
        tf.cond(condition, lambda: fn(), tensors.nothing)

    def assert_that(self, condition: Callable[[], Any], message: str) -> Any:
        if tf.executing_eagerly():
            return None
        return tf.debugging.Assert(condition(), [message])

    @contextlib.contextmanager
    def guarded(self, condition: Callable[[], Any], message: str) -> Iterator[None]:
        check = self.assert_that(condition, message)
        with tf.control_dependencies([] if check is None else [check]):
            yield

    # ------------------------------------------------------------------
    # Distribution.

    def replicas(self) -> int:
        return distribution.replicas_in_sync()

    def replica_id(self) -> int:
        return distribution.replica_id()

    def sum_over_replicas(self, values: Any) -> Any:
        return distribution.sum_over_replicas(values)

    def clip_as_one_device(self, grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
        return distribution.clip_as_one_device(grads, clip)

    def on_each_replica(self, family: Any, fn: Callable[[], None]) -> None:
        strategy = family.strategy()
        if strategy.num_replicas_in_sync > 1 and not distribution.in_replica_context():
            distribution.run_per_replica(strategy, fn)
        else:
            fn()

    def usable_here(self, value: Any) -> bool:
        return tensors.usable_here(value)

    def any_nonzero(self, variables: Sequence[Any]) -> Any:
        return tensors.any_nonzero(variables)

    # ------------------------------------------------------------------
    # Sparse gradients.

    def is_slices(self, grad: Any) -> bool:
        return isinstance(grad, tf.IndexedSlices)

    def scatter_into(self, accumulator: Any, grad: Any, weight: Any, first: Any) -> None:
        tensors.scatter_into(accumulator, grad, weight, first)

    def new_kept(self, family: Any, variable: Any, accumulator: Any, n: Any, keep_all: bool,
                 steps: Callable[[], int]) -> Kept:
        """A variable's kept slices (`gradaccum._backend.tensorflow.kept`)."""
        return Kept(variable, accumulator, family, n, keep_all, steps)

    def keep_slices(self, kept: Kept, grad: Any, weight: Any, first: Any) -> None:
        kept.add(grad, weight, first)

    def kept_slices(self, kept: Kept, divisor: Any) -> Any:
        return kept.read(divisor)

    def kept_local(self, kept: Kept) -> Any:
        return kept.read(None, local=True)

    def kept_counters(self, kept: Kept) -> list[Any]:
        return kept.counters()

    # ------------------------------------------------------------------
    # Gradients and losses as the layers above the core see them.

    def densify(self, grad: Any) -> Any:
        return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad

    def scale_gradient(self, grad: Any, factor: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
        return grad * tf.cast(factor, grad.dtype)

    def shape_and_entries(self, values: Any, weight: Any) -> tuple[tuple[int | None, ...] | None, Any]:
        # A traced step may know neither the batch size nor the rank.
        static, dynamic = values.shape, tf.shape(values)
        if weight is not None:
            static = tf.broadcast_static_shape(values.shape, weight.shape)
            dynamic = tf.broadcast_dynamic_shape(tf.shape(values), tf.shape(weight))
        entries = tf.cast(tf.reduce_prod(dynamic), tf.float32)
        return (None if static.rank is None else tuple(static.as_list())), entries

    def no_op(self) -> Any:
        return tf.no_op()

    def delegate_tracking(self, optimizer: Any, inner: Any) -> None:
        delegating = tf.__internal__.tracking.DelegatingTrackableMixin
        if isinstance(optimizer, delegating):
            delegating.__init__(optimizer, inner)


def _conditions(update: Update) -> dict[int, tf.Tensor]:
    """The update's conditions, read now, by position in its variables."""
    return {k: condition() if callable(condition) else condition for k, condition in update.conditions.items()}


def _owned(update: Update, conditions: dict[int, tf.Tensor]) -> list[tuple[tf.Variable, tf.Tensor]]:
    """Each of the update's variables with a condition, and its slots
    (`OptimizerFamily.slots`), paired with that condition: where it does
    not hold (no gradient in the cycle), they keep their values. Warns
    where the family cannot attribute some of its state."""
    family = update.family
    if not conditions:
        return []
    variables = [update.taking_part[k] for k in conditions]
    slots = family.slots(variables)
    if slots is None:
        _warn_conditions(family, [])
        return []
    owned = []
    for variable, own, condition in zip(variables, slots, conditions.values()):
        owned += [(v, condition) for v in [family.model_variable(variable), *own]]
    unattributed = family.unattributed_state()
    if unattributed:
        _warn_conditions(family, unattributed)
    return owned


def _warn_conditions(family: Any, unattributed: list[tf.Variable]) -> None:
    """Warns that a snapshot update moves `unattributed` (all the optimizer's
    state where empty) for a variable without a gradient in the cycle."""
    what = f"its state {[v.name for v in unattributed]}" if unattributed else "its state"
    warnings.warn(
        f"{type(family.optimizer).__name__} overrides how Keras applies an update, so gradaccum runs "
        "its update whole and then puts back the variables that received no gradient in the cycle, "
        "and their slots (kept in lists of one entry per variable, as Keras's optimizers keep them). "
        f"Where a variable receives no gradient in a whole cycle, {what} moves as if it had received "
        "the gradient 0 (the large batch would leave it as it is): state kept otherwise, or EMA's "
        "averages, which the update computes from the variables it moved. Give every variable a "
        "gradient on every micro-step to avoid it.",
        stacklevel=2,
    )


def _quotients(update: Update) -> list[tf.Tensor]:
    """The accumulators' values, the divided ones divided on the apply step.

    Traced, divided in place on the apply step, so the update reads the
    quotients without a second copy of the sums. Eagerly the step is known:
    divided into new tensors, which costs the same, and an update that
    raises leaves the sums as they were.
    """
    divided = [d and update.divisor is not None for d in update.divided]
    if tf.executing_eagerly():
        values = _read(update.accumulators)
        if not bool(update.ends):
            return values
        return [v / tf.cast(update.divisor, v.dtype) if d else v for v, d in zip(values, divided)]
    in_place = [a for a, d in zip(update.accumulators, divided) if d]
    if in_place:
        tensors.divide_if(update.ends, in_place, update.divisor)
    return _read(update.accumulators)


def _read(accumulators: Sequence[Any]) -> list[tf.Tensor]:
    # In replica context each replica reads its own accumulators.
    # `read_value()`, not `value()`: under MultiWorkerMirroredStrategy the
    # gradient all-reduce needs a read placed on the variable's device.
    return [a.read_value() for a in accumulators]
