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
  into new tensors, so an update that raises leaves the sums. On one
  replica without XLA, where there is nothing to synchronise, the whole
  update (reads, division into new tensors, clipping, writes) is that one
  branch.
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
from gradaccum._backend.tensorflow.kept import Kept, saved_for_restore
from gradaccum._backend.tensorflow.replicas import TensorFlowReplicas


class TensorFlowBackend:
    """The hooks of `gradaccum._backend.Backend` on TensorFlow."""

    counter_dtype = "int64"
    reads_back = True
    tensors = tensors.TensorFlowTensors()
    replicas = TensorFlowReplicas()
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
        if tf.executing_eagerly() and distribution.in_replica_context():
            # Each replica writes its own copy, without the merge call a
            # mirrored variable's write makes: a failure in a merge call
            # stops the replicas' later ones, which the restore of the failed
            # step (`gradaccum._atomic`) would wait on for ever. Every replica
            # writes a mirrored counter's same value (`mirrored_counter`).
            variable = distribution.local_copy(variable)
        variable.assign(tf.cast(value, variable.dtype), read_value=False)

    def finish(self, update: Update, mode: str) -> None:
        if mode == "masked":
            self._masked(update)
        else:
            self._skipped(update)

    def _masked(self, update: Update) -> None:
        family = update.family
        strategy = family.strategy()
        if _in_one_branch(update, strategy):
            return
        values = _quotients(update)
        conditions = _conditions(update)
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

    def kept_saved(self, kept: Kept) -> Callable[[], None]:
        return saved_for_restore(kept)



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
    variables = [update.took_part[k] for k in conditions]
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


def _in_one_branch(update: Update, strategy: tf.distribute.Strategy) -> bool:
    """Runs a traced masked update of one replica, outside XLA, in one branch.

    With one replica there is no all-reduce to keep out of a branch, so
    everything of the update (the reads, the division of the sums,
    unscaling, clipping and the writes) runs in one `tf.cond` taken on the
    apply step: an in-between micro-step runs no part of it, as with
    Keras's own `gradient_accumulation_steps`. Elsewhere (eagerly, under
    XLA, several replicas, an update `split_apply` cannot run) nothing is
    done.

    The sums are divided into new tensors, not in place: a quotient that
    no variable holds is a buffer the optimizer's update may write its
    own results into (TensorFlow forwards an input's buffer to an output
    where nothing else holds it), where one written back into an
    accumulator makes each of its readers allocate and fill a buffer of
    its own. The quotients, alive together until the update has read
    them, take as much memory as the micro-step's gradients, which are
    alive together until the add before the branch takes them all.

    Returns:
        Whether the update was run so.
    """
    family = update.family
    if (
        tf.executing_eagerly()
        or tensors.compiled_by_xla()
        or strategy.num_replicas_in_sync > 1
        or not tf.__internal__.distribute.strategy_supports_no_merge_call()
        or not family.masks_writes
        or not updates.splits(family.optimizer, strategy, bool(update.conditions))
    ):
        return False
    divisor = update.divisor

    def run() -> None:
        values = _read(update.accumulators)
        if divisor is not None:
            values = [v / tf.cast(divisor, v.dtype) if d else v for v, d in zip(values, update.divided)]
        # Inside the branch the cycle ends: only the conditions remain.
        update.apply(values, masking=updates.Masking(None, _conditions(update)))

    tf.cond(update.ends, run, tensors.nothing)
    return True


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
