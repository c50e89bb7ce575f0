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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from gradaccum._backend import StateVariables, Update
from gradaccum._backend.position import DevicePosition, Position
from gradaccum._backend.tensorflow import distribution, tensors, updates
from gradaccum._backend.tensorflow.gradients import TensorFlowGradients
from gradaccum._backend.tensorflow.kept import Kept


class TensorFlowBackend:
    """The hooks of `gradaccum._backend.Backend` on TensorFlow."""

    counter_dtype = "int64"
    reads_back = True
    tensors = tensors.TensorFlowTensors()
    replicas = distribution.TensorFlowReplicas()
    gradients = TensorFlowGradients()

    # ------------------------------------------------------------------
    # State.

    def create_state(
        self, family: Any, variables: Sequence[Any], n: int | None, dtype: str = "float32"
    ) -> StateVariables:
        accumulators = self.new_accumulators(family, variables, dtype)
        with distribution.creation_scope(family.strategy()):
            took_part = None
            if self.masks_each(family):
                took_part = distribution.mirrored_counter(tf.ones([len(variables)], tf.int32), name="touched")
            return StateVariables(
                accumulators=accumulators,
                micro_step=distribution.mirrored_counter(0, name="micro_step"),
                weight_total=distribution.replica_local(tf.constant(0.0), name="weight_total"),
                n=None if n is None else distribution.mirrored_counter(n, name="n"),
                took_part=took_part,
            )

    def masks_each(self, family: Any) -> bool:
        """Whether an update can leave out at run time its variables that did
        not take part: for families whose every write is a variable's write
        method and whose per-variable update synchronises nothing (Keras 3)."""
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

    def position(self, counter: Any, flags: Any) -> Position:
        return DevicePosition(self, counter, flags)

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

    def after(self, grads: Sequence[Any], variables: Sequence[Any], weight: Any
              ) -> contextlib.AbstractContextManager[None]:
        return tensors.after(grads, variables, weight)

    def ordered(self, value: Any) -> Any:
        return value if tf.executing_eagerly() else tf.identity(value)

    def scalar_variable(self, family: Any, name: str) -> Any:
        with distribution.creation_scope(family.strategy()):
            return distribution.replica_local(tf.constant(0.0), name=name)

    def assign(self, variable: Any, value: Any) -> None:
        variable.assign(tf.cast(value, variable.dtype), read_value=False)

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
        if conditions:
            _warn_conditions(family)
        # Every variable the optimizer was built for, not only those in this
        # update: with `ema_overwrite_frequency` Keras overwrites all of them
        # with their moving averages, gradient or not.
        tracked = family.state_variables() + [family.model_variable(v) for v in update.variables]
        updates.snapshot_update(strategy, update.ends, tracked, lambda: update.apply(values))

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
            _warn_conditions(family)
            update.apply(values, divisor)

        inputs = [values] if update.divisor is None else [values, update.divisor]
        updates.skipped_update(update.ends, apply, *inputs)

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        if tf.executing_eagerly():
            if bool(condition):
                fn()
            return
        tf.cond(condition, lambda: fn(), tensors.nothing)

    # ------------------------------------------------------------------
    # Kept slices (`gradaccum._backend.KeptSlices`).

    def scatter_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        for accumulator, grad in zip(accumulators, grads):
            tensors.scatter_into(accumulator, grad, weight, first)

    def new_kept(self, family: Any, variable: Any, accumulator: Any, n: Any, keep_all: bool,
                 steps: Callable[[], int]) -> Kept:
        """A variable's kept slices (`gradaccum._backend.tensorflow.kept`)."""
        return Kept(variable, accumulator, family, n, keep_all, steps)

    def keep_slices(self, kept: Sequence[Kept], grads: Sequence[Any], weight: Any, first: Any) -> None:
        for held, grad in zip(kept, grads):
            held.add(grad, weight, first)

    def kept_slices(self, kept: Kept, divisor: Any) -> Any:
        return kept.read(divisor)

    def kept_local(self, kept: Kept) -> Any:
        return kept.read(None, local=True)

    def kept_counters(self, kept: Kept) -> list[Any]:
        return kept.counters()



def _conditions(update: Update) -> dict[int, tf.Tensor]:
    """The update's conditions, read now, by position in its variables."""
    return {k: condition() if callable(condition) else condition for k, condition in update.conditions.items()}


def _warn_conditions(family: Any) -> None:
    warnings.warn(
        f"{type(family.optimizer).__name__} overrides how Keras applies an update, so under this "
        "distribution strategy gradaccum cannot leave out of the cycle's update a variable that "
        "received no gradient in the cycle: it is updated with the gradient 0 (the large batch "
        "would leave it as it is). Give every variable a gradient on every micro-step, or use "
        "one of Keras's optimizers.",
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
