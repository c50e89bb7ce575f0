"""The accumulating core of one optimizer: one micro-step, and `flush`.

`Accumulation` ties the pieces together: the wrapped optimizer's family,
the cycle's length (`gradaccum._cycle`), the state (`gradaccum._state`),
built with the optimizer, and the strategy chosen then
(`gradaccum._strategies`). A micro-step:

1. checks the gradients and builds (or grows) the state if needed;
2. with `n=1`, hands the gradients straight to the wrapped optimizer;
3. otherwise adds them to the accumulators (`strategy.add`), and
4. runs the end of the cycle, kept only if this micro-step completes it
   (`strategy.finish_if`), then advances or resets the micro-step counter.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from gradaccum._accumulation_base import AccumulationBase
from gradaccum._agc import AdaptiveClipping
from gradaccum._backend.tensorflow import distribution, tensors
from gradaccum._cycle import CycleLength
from gradaccum._family import OptimizerFamily
from gradaccum._state import AccumulationState, State
from gradaccum._strategies import CycleStrategy, choose, deliver
from gradaccum._validation import check_step_arguments, check_weight, check_weight_value


def _name(variable: Any, default: str) -> str:
    return getattr(variable, "path", default)


class Accumulation(AccumulationBase):
    """Gradient accumulation for one optimizer (see the module docstring).

    Args:
        family: The wrapped optimizer's family.
        n: Micro-batches per update, an int or a schedule (checked).
        reduction: `"mean"` or `"sum"` (checked).
        mode: `"masked"` or `"skip"` (checked).
        weigh_by: `"count"` or `"batch"` (checked; see
            `gradaccum._accumulation_base.AccumulationBase`).
        on_built: Called with the state's checkpoint module once the state
            exists (the proxy restores what a checkpoint deferred for it).
        sparse: `"rows"` or `"slices"` (checked): whether `tf.IndexedSlices`
            gradients are added into their rows or kept as slices.
        agc: Adaptive gradient clipping of every update's gradient
            (`gradaccum._agc`), or None.
    """

    # None until built (the base sets it).
    state: State | None

    def __init__(
        self,
        family: OptimizerFamily,
        n: Any,
        reduction: str,
        mode: str,
        weigh_by: str,
        on_built: Callable[[tf.Module], None],
        sparse: str = "rows",
        agc: AdaptiveClipping | None = None,
    ):
        super().__init__(family, CycleLength(n), reduction, mode, weigh_by, on_built, sparse, agc)
        self.strategy: CycleStrategy | None = None
        # Loss counts handed over for the next micro-step, by replica: each
        # replica computes its loss and applies in a thread of its own.
        self._counts: dict[int, Any] = {}
        # Extra `apply_gradients` arguments of the latest micro-step, for the
        # update its cycle ends with (also when `flush()` ends it).
        self._options: Mapping[str, Any] = {}

    # ------------------------------------------------------------------
    # Read-only views.

    def own_variables(self) -> list[Any]:
        """Empty here: TensorFlow's state is tracked by checkpoints, not
        listed in the optimizer's `variables` (see the portable core)."""
        return []

    def micro_step(self) -> tf.Tensor:
        if self.state is None:
            return tf.constant(0, dtype=tf.int64)
        return tf.identity(self.state.micro_step)

    def will_apply(self) -> tf.Tensor:
        return self.micro_step() + 1 >= self.current_n()

    def view(self) -> AccumulationState | None:
        state = self.state
        if state is None:
            return None
        state.settle()
        return AccumulationState(
            variables=tuple(state.variables),
            accumulators=tuple(state.accumulators),
            micro_step=tf.identity(state.micro_step),
            weight_total=tf.identity(state.weight_total),
            kept_slices=state.all_kept(),
        )

    # ------------------------------------------------------------------
    # Building.

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer (if needed) and the state."""
        family = self.family
        if not family.built:
            family.build(variables)
        if self.state is None:
            self._build_state(family.trainable_variables())
        elif family.grows:
            self.state.indices_of(list(variables))  # adds those not met yet

    def _build_state(self, variables: list[Any]) -> None:
        if self.sparse == "slices" and self.family.strategy().num_replicas_in_sync > 1:
            raise ValueError(
                "sparse=\"slices\" works on one device only: under a "
                "distribution strategy with more than one replica use "
                "sparse=\"rows\" (the default)."
            )
        state = State(
            self.family, variables, self.cycle.code, self.reduction,
            sparse_slices=self.sparse == "slices",
        )
        self.strategy = choose(self.mode, state, self.family, self.reduction, self.agc)
        with distribution.creation_scope(self.family.strategy()):
            self.cycle.build()
        self.state = state
        self._on_built(state.module)
        waiting = self._take_waiting()
        # Values loaded before the variables existed are assigned once, as a
        # restore would: eagerly, not as ops of a traced step.
        with tf.init_scope():
            for callback in waiting:
                callback()

    # ------------------------------------------------------------------
    # A micro-step.

    def count_next(self, count: Any) -> None:
        """Hands the next micro-step the count its loss was divided by.

        `model.fit`'s loss computation calls this (see
        `gradaccum._loss_counts`) right before the train step applies the
        gradients of that loss. The next micro-step of this replica without
        an explicit `weight` weighs `count`; with `weigh_by="batch"`, or
        `count=None`, it weighs 1. A count is used once, only in the
        `tf.function` (or the eager run) it was computed in; a newer count
        replaces one not used yet.

        Args:
            count: A scalar float32 tensor, or None.
        """
        replica = distribution.replica_id()
        if count is None or self.weigh_by != "count":
            self._counts.pop(replica, None)
        else:
            self._counts[replica] = count

    def _take_count(self) -> Any:
        count = self._counts.pop(distribution.replica_id(), None)
        if count is None or not tensors.usable_here(count):
            return None
        return count

    def step(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any] | None,
        weight: Any,
        options: Mapping[str, Any],
    ) -> None:
        """Accumulates one micro-batch; applies if it completes the cycle.

        Raises:
            ValueError: See `AccumulatingOptimizer.apply`.
        """
        self._options = options
        weight = check_weight(weight)
        if weight is not None and not isinstance(weight, float) and tf.executing_eagerly():
            # A tensor's value is known eagerly (traced, it cannot be checked).
            check_weight_value(float(weight))
        if weight is None:
            weight, self._handed_weight = self._handed_weight, None
        # An explicit weight wins over the loss's count; taken either way,
        # so that a count never outlives its step.
        count = self._take_count()
        grads, variables = check_step_arguments(
            grads, variables, self.state.variables if self.built else None
        )
        if not grads:
            return
        if not self.built:
            self.build(variables)
        state = self.state
        indices = state.indices_of(variables)
        if all(g is None for g in grads):
            raise ValueError("No gradients provided for any variable (every gradient is None).")
        if self.cycle.hands_over() and weight is None and not state.has_participants():
            # Every micro-batch is a whole batch: hand the gradients over as
            # they are. Accumulating first would densify `IndexedSlices`
            # (summing repeated rows, which Keras applies one by one) and give
            # variables without a gradient zeros instead of skipping them.
            # (Once anything was accumulated, with another `n` set before,
            # the accumulating path below finishes that cycle instead.)
            with tf.control_dependencies(self.cycle.hand_over_guard()):
                if self.agc is None:
                    # The plain optimizer, bit for bit (its own per-replica
                    # clipping included).
                    self.family.apply(grads, variables, options)
                else:
                    deliver(self.family, self.agc, grads, variables, options)
            return
        if weight is None:
            # With `n=1` (above) a weighted mean over one micro-batch is
            # that micro-batch, so the count matters from here on only.
            weight = count
        state.refresh_participants()
        self._check_unmet(lambda: state.micro_step.value() + 1 >= self.current_n())
        count = state.micro_step.value() + 1
        keep_new = count >= self.current_n()
        sums = self.strategy.add(grads, indices, weight, keep_new)
        self._finish_if(keep_new, count, sums)

    def flush(self) -> None:
        """Applies what the current cycle holds now, if anything."""
        self._flush_followers()
        state = self.state
        if state is None:
            return
        state.refresh_participants()
        if not state.has_participants():
            return
        strategy = self.family.strategy()
        if strategy.num_replicas_in_sync > 1 and not distribution.in_replica_context():
            # Each replica flushes its own share, as on a micro-step.
            distribution.run_per_replica(strategy, self._flush_here)
            return
        self._flush_here()

    def _flush_here(self) -> None:
        count = self.state.micro_step.value()
        self._check_unmet(lambda: count > 0)
        self._finish_if(count > 0, count)

    def _finish_if(
        self, keep_new: tf.Tensor, count: tf.Tensor, sums: Mapping[int, tf.Tensor] | None = None
    ) -> None:
        state = self.state
        self._check_left_out(keep_new)
        self.strategy.finish_if(keep_new, state.participants(), self._options, sums)
        state.micro_step.assign(tensors.select(keep_new, tf.zeros_like(count), count))

    # ------------------------------------------------------------------
    # Refusals.

    def _check_unmet(self, ends_cycle: Callable[[], tf.Tensor]) -> None:
        """Refuses to end a cycle without restored sums it cannot hold yet.

        A checkpoint of an optimizer that grew (see `build`) may hold
        accumulators for variables that an optimizer restored from it has
        not met yet: their restore waits until they are added, and an update
        before then would leave their accumulated gradients out. Raises
        eagerly if `ends_cycle()`; while tracing, always (a traced step that
        has not met them never will, and an assertion in the graph would not
        stop the step's writes).
        """
        unmet = self.state.unmet()
        if not unmet:
            return
        held = len(self.state.variables)
        message = (
            "The restored accumulation state holds gradients for "
            f"variables at positions {unmet}, which this optimizer has not "
            f"met yet (it holds {held}); an update now "
            "would leave them out. Build the optimizer with all variables, in "
            "the order the saved one met them, before its first step after "
            "the restore: `opt.build(model.trainable_variables)`."
        )
        if not tf.executing_eagerly() or bool(ends_cycle()):
            raise ValueError(message)

    def _check_left_out(self, keep_new: tf.Tensor) -> None:
        """Refuses to drop gradients a traced step cannot see.

        Which variables take part in an update is decided while a step is
        traced, from the variables that have received gradients so far. A
        `tf.function` traced before some variable first received a gradient
        (for example one trace per task in multi-task training) leaves it out;
        if it then runs an apply step while that variable has accumulated
        gradients, they would be neither applied nor cleared. That raises
        instead. Eager steps always see every variable.
        """
        if tf.executing_eagerly():
            return
        state = self.state
        left_out = state.left_out()
        if not left_out:
            return
        pending = tensors.any_nonzero([state.accumulators[i] for i in left_out])
        names = [_name(state.variables[i], str(i)) for i in left_out]
        tf.debugging.Assert(
            tf.logical_not(tf.logical_and(keep_new, pending)),
            [
                "gradaccum: this traced step was traced before variables "
                f"{names} first received gradients, and leaves them out of the "
                "update, but they hold accumulated gradients now. Trace every "
                "step after each variable has received a gradient once (for "
                "example run one step per task eagerly first), or trace this "
                "step anew (a new tf.function)."
            ],
        )
