"""The accumulating core on JAX and PyTorch: one micro-step, and `flush`.

The same cycle as on TensorFlow (`gradaccum._accumulation`), written with
Keras ops. A micro-step adds the (weighted) gradients into the accumulators
and advances the micro-step counter; the step that completes the cycle hands
the wrapped optimizer the accumulated mean (or sum) once; the next cycle's
first micro-step writes over the sums (`gradaccum._portable.state`).

The update runs only on the step that completes the cycle, in both modes:
where that is known before the update would run (PyTorch, and JAX outside
`jit`) under Python's `if`, with the accumulators written in place; traced
by JAX, in a `jax.lax.cond` whose branches are pure functions of the
variables' values (`gradaccum._backend.portable.run_if`). On TensorFlow the
masked mode keeps every collective of the update on every micro-step,
because `tf.distribute` all-reduces inside `apply_gradients`. Here the
update holds no communication: JAX's compiled step averages the gradients
over devices before the optimizer runs (a collective in an optimizer over
sharded variables sits in the `cond` of every device alike, its predicate
being replicated), and Keras trains PyTorch on one device. So `mode` makes
no difference to what runs on these backends; it is kept, saved and
restored as given, so that code and files move between backends.

So the micro-steps in between change no model variable and no
optimizer state, so `iterations`, schedules, EMA, clipping, weight decay and
constraints see what training on the large batch sees.

JAX runs the optimizer without side effects: `stateless_apply` maps every
variable (the model's, the wrapped optimizer's and the accumulation state's,
which the proxy lists in `variables`) to a value, runs `apply` in a
`StatelessScope` and returns the new values.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import keras
from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope

from gradaccum._accumulation_base import AccumulationBase
from gradaccum._agc import AdaptiveClipping
from gradaccum._backend import portable as control
from gradaccum._portable.state import State
from gradaccum._cycle import CycleLength
from gradaccum._family import OptimizerFamily
from gradaccum._validation import check_step_arguments, check_weight, check_weight_value
from gradaccum._view import AccumulationState


class _Cycle(CycleLength):
    """`n` read from the state's variable, or from the schedule, with Keras ops."""

    def build(self) -> None:
        # The variable belongs to the state (it travels with it on JAX);
        # `Accumulation` points `_variable` at it.
        return None

    def current(self, applied: Any) -> Any:
        if self.schedule is not None:
            n = ops.cast(self.schedule(applied), "int32")
            if not control.is_traced(n) and int(n) < 1:
                raise ValueError(f"The `n` schedule returned {int(n)}; it must return an int >= 1.")
            return ops.maximum(n, 1)
        if self._variable is None:
            return ops.convert_to_tensor(self._n, dtype="int32")
        return self._variable.value

    def hand_over_guard(self) -> list[Any]:
        # A step traced with n=1 keeps handing over; setting `n` then warns
        # (`CycleLength.set`). JAX has no cheap run-time assertion to stop
        # such a step, as TensorFlow's guard does.
        return []


class Accumulation(AccumulationBase):
    """Gradient accumulation for one optimizer on JAX or PyTorch.

    The interface of `gradaccum._accumulation_base.AccumulationBase` (see
    there, and `gradaccum._accumulation.Accumulation`, for the arguments),
    plus `stateless_apply`.

    Raises:
        ValueError: For `sparse="slices"`, which needs `tf.IndexedSlices`.
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
        on_built: Callable[[Any], None],
        sparse: str = "rows",
        agc: AdaptiveClipping | None = None,
    ):
        if sparse != "rows":
            raise ValueError(
                f"sparse={sparse!r} keeps `tf.IndexedSlices`, which only the "
                f"TensorFlow backend has; the active Keras backend is "
                f"{keras.config.backend()!r}. Use sparse=\"rows\" (the default)."
            )
        super().__init__(family, _Cycle(n), reduction, mode, weigh_by, on_built, sparse, agc)
        # The count handed over by the loss computation for the next
        # micro-step (one device: no replica threads on these backends).
        self._count: Any = None

    # ------------------------------------------------------------------
    # Read-only views.

    def micro_step(self) -> Any:
        if self.state is None:
            return ops.convert_to_tensor(0, dtype="int32")
        return control.snapshot(self.state.micro_step)

    def will_apply(self) -> Any:
        return ops.greater_equal(self.micro_step() + 1, self.current_n())

    def view(self) -> AccumulationState | None:
        state = self.state
        if state is None:
            return None
        state.settle()
        return AccumulationState(
            variables=tuple(state.variables),
            accumulators=tuple(state.accumulators),
            micro_step=control.snapshot(state.micro_step),
            weight_total=control.snapshot(state.weight_total),
        )

    def own_variables(self) -> list[Any]:
        """The state's variables (empty until built), which the proxy lists
        after the wrapped optimizer's in `variables`."""
        return [] if self.state is None else self.state.variables_list()

    # ------------------------------------------------------------------
    # Building.

    def build(self, variables: Sequence[Any]) -> None:
        family = self.family
        if not family.built:
            family.build(variables)
        if self.state is None:
            self._build_state(family.trainable_variables())

    def _build_state(self, variables: list[Any]) -> None:
        if control.is_traced(self.family.iterations.value):
            raise ValueError(
                "The accumulating optimizer must be built before it is traced "
                "by `jax.jit`: call `optimizer.build(model.trainable_variables)` "
                "first (`model.fit` does)."
            )
        n = None if self.cycle.schedule is not None else self.cycle.value
        self.state = State(variables, n, self.cycle.code, self.reduction)
        self.cycle._variable = self.state.n
        self._on_built(None)
        for callback in self._take_waiting():
            callback()

    # ------------------------------------------------------------------
    # A micro-step.

    def count_next(self, count: Any) -> None:
        self._count = count if self.weigh_by == "count" else None

    def step(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any] | None,
        weight: Any,
        options: Mapping[str, Any],
    ) -> None:
        weight = check_weight(weight)
        if weight is not None:
            self._check_weight_value(weight)
        else:
            weight, self._handed_weight = self._handed_weight, None
        count, self._count = self._count, None
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
        if self.cycle.hands_over() and weight is None and not state.participants():
            # Every micro-batch is a whole batch: the plain optimizer, bit
            # for bit (see the TensorFlow core).
            if control.is_traced(state.micro_step.value):
                self.cycle._handed_over_in_trace = True
            self._deliver(grads, variables)
            return
        if weight is None:
            # A count Keras divided the loss by (never negative).
            weight = count
        # The accumulators still hold the last cycle's sums after it was
        # applied (see `gradaccum._portable.state`): a cycle's first
        # micro-step writes over them.
        fresh = ops.equal(state.micro_step.value, 0)
        if not control.is_traced(fresh):
            fresh = bool(fresh)  # read once, not once per variable
        added = set()
        for i, g in zip(indices, grads):
            if g is None:
                continue
            state.seen[i] = True
            added.add(i)
            control.add_into(state.accumulators[i], g, weight, fresh)
        for i in state.participants():
            if i not in added:
                control.clear_if(state.accumulators[i], fresh)
        added = 1.0 if weight is None else ops.cast(weight, "float32")
        state.weight_total.assign(state.weight_total.value + added)
        steps = state.micro_step.value + 1
        self._finish_if(ops.greater_equal(steps, self.current_n()), steps)

    @staticmethod
    def _check_weight_value(weight: Any) -> None:
        """Refuses an explicit weight tensor that is negative or not finite,
        where its value is known (a number was checked by `check_weight`; a
        traced value cannot be)."""
        if isinstance(weight, float) or control.is_traced(weight):
            return
        check_weight_value(float(ops.convert_to_numpy(weight)))

    def flush(self) -> None:
        self._flush_followers()
        state = self.state
        if state is None or not state.participants():
            return
        steps = state.micro_step.value
        if not control.is_traced(steps) and int(ops.convert_to_numpy(steps)) == 0:
            return  # an empty cycle
        self._finish_if(ops.greater(steps, 0), steps)

    # ------------------------------------------------------------------
    # The end of a cycle.

    def _deliver(self, grads: list[Any], variables: list[Any]) -> None:
        """The wrapped optimizer's update (AGC first, if on)."""
        if self.agc is not None:
            grads = self.agc.clip(grads, variables, self.family.gradient_scale())
        self.family.apply(grads, variables, {})

    def _finish_if(self, ends: Any, steps: Any) -> None:
        """Applies the accumulated update if `ends`, and clears the cycle
        then; otherwise only advances the micro-step counter to `steps`."""
        state = self.state
        indices = state.participants()
        variables = [state.variables[i] for i in indices]
        total = state.weight_total.value
        accumulators = [state.accumulators[i] for i in indices]
        # Read here: traced by JAX, the update below may run in a branch that
        # sees only the variables it writes.
        sums = [acc.value for acc in accumulators]
        divide = self.reduction == "mean"

        def update() -> None:
            # No division by zero if every weight was 0 (the sums are 0 then
            # too).
            divisor = ops.where(total > 0, total, 1.0)
            grads = [control.quotient(acc, divisor) if divide else acc for acc in sums]
            self._deliver([ops.cast(g, v.dtype) for g, v in zip(grads, variables)], variables)

        if not control.is_traced(ends):
            # PyTorch, and JAX outside `jit`: whether the cycle ends is known
            # before the update would run, and nothing is traced, so both
            # modes run the update on apply steps only (a Python `if` crosses
            # no replica synchronisation here) and write the accumulators in
            # place.
            if bool(ends):
                if divide:
                    sums = [control.divide_in_place(acc, ops.where(total > 0, total, 1.0)) for acc in accumulators]
                    divide = False
                update()
                state.weight_total.assign(0.0)
                state.micro_step.assign(0)
            else:
                state.micro_step.assign(steps)
            return
        model = list(self.family.trainable_variables())
        known = {id(m) for m in model}
        watched = model + [v for v in self.family.state_variables() if id(v) not in known]
        # Traced by JAX, both modes run the update in a `jax.lax.cond`: a
        # select between the update's new values and the old ones (a pure
        # masked update) costs XLA on the CPU six times the update itself
        # (benchmarks/RESULTS.md), and the update holds no communication a
        # branch could put out of step (see the module docstring).
        control.run_if(ends, update, watched)
        # The accumulators are not cleared here: a select writing zeros
        # would keep each sum alive beside the `cond` that reads it, a copy
        # of the parameters on every micro-step (benchmarks/RESULTS.md).
        # The next cycle's first micro-step writes over them instead.
        state.weight_total.assign(ops.where(ends, 0.0, total))
        state.micro_step.assign(ops.where(ends, 0, steps))

    # ------------------------------------------------------------------
    # JAX: the optimizer as a function of its variables' values.

    def stateless_apply(
        self,
        apply: Callable[[list[Any], list[Any]], None],
        own_variables: list[Any],
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
    ) -> tuple[list[Any], list[Any]]:
        """`optimizer.stateless_apply` of the proxy: runs `apply` (the
        proxy's) on the given values and returns the new ones.

        Args:
            apply: The proxy's `apply`.
            own_variables: The proxy's `variables` (the wrapped optimizer's,
                then the state's).
            optimizer_variables: Their values, in that order.
            grads: One gradient per trainable variable.
            trainable_variables: The model's trainable variables' values.

        Returns:
            `(trainable_variables, optimizer_variables)`: the new values.

        Raises:
            ValueError: If the optimizer is not built, or the lists do not
                match its variables.
        """
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, the accumulating optimizer must be "
                "built: call `optimizer.build(trainable_variables)` first."
            )
        model = self.family.trainable_variables()
        if len(optimizer_variables) != len(own_variables):
            raise ValueError(
                "Argument `optimizer_variables` must hold one value per "
                f"variable of `optimizer.variables` ({len(own_variables)}, the "
                "wrapped optimizer's and the accumulation state's). Received "
                f"{len(optimizer_variables)}."
            )
        if len(trainable_variables) != len(model):
            raise ValueError(
                f"Argument `trainable_variables` must hold {len(model)} values "
                f"(one per variable the optimizer was built for). Received "
                f"{len(trainable_variables)}."
            )
        mapping = list(zip(model, trainable_variables)) + list(zip(own_variables, optimizer_variables))
        with StatelessScope(state_mapping=mapping) as scope:
            apply(list(grads), model)
        return (
            [scope.get_current_value(v) for v in model],
            [scope.get_current_value(v) for v in own_variables],
        )

