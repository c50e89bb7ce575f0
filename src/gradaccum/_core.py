"""The accumulating core: one micro-step, written once for every backend.

`Core` runs the cycle of one optimizer. A micro-step (`step`):

1. takes the micro-batch's weight: an explicit `weight`, else one a
   loss-scale wrapping hands over (`weighing`), else the count its loss was
   divided by (`count_next`, from `gradaccum._loss_counts`), else 1;
2. checks the gradients, and builds (or grows) the wrapped optimizer and the
   state (`gradaccum._state`) on first use;
3. with `n=1`, hands the gradients straight to the wrapped optimizer;
4. otherwise adds them into the accumulators (`Tensors.add_into`); on a
   cycle's first micro-step it writes over them instead, so the end of a
   cycle never clears them: a clearing after the update, which reads the
   sums inside a branch, would make XLA copy every accumulator on every
   micro-step. A variable Keras marks `overwrite_with_gradient`
   (float8 scales) keeps the cycle's elementwise maximum instead, as
   Keras's own `gradient_accumulation_steps` does, and the apply step
   writes it undivided;
5. hands the backend the cycle's update (`gradaccum._cycle_end`), which
   takes effect only if this micro-step ends the cycle and involves only
   the variables that took part in the cycle; its gradients reach
   the wrapped optimizer clipped as one device training on the large batch
   would clip them (AGC, then, under several replicas, the optimizer's own
   clipping of the replica sum);
6. advances the micro-step counter, or resets it on the apply step.

A step that raises leaves the state as it was (`gradaccum._atomic`): traced,
its writes wait for its gradients and weight (`Backend.after`); eagerly, an
in-between step runs no update, and the step that ends a cycle puts the
state back if the update raises.

The backend hooks (`gradaccum._backend`) say how each of those runs on
TensorFlow (replicas, graphs, XLA) or on JAX and PyTorch (Keras ops).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from keras import ops

from gradaccum import _agc, _compensated, _micro_batches
from gradaccum._adaptive import NoiseScaleSchedule
from gradaccum._atomic import unchanged_if_raised
from gradaccum._backend import Backend
from gradaccum._cycle import Cycle
from gradaccum._cycle_end import deliver, end_cycle
from gradaccum._noise import Noise
from gradaccum._settings import Settings
from gradaccum._state import COMPENSATED, GROUPS, MAXIMUM, SCATTERED, SLICES, SUM, State
from gradaccum._validation import check_gradient_shapes, check_step_arguments
from gradaccum._view import AccumulationState
from gradaccum._weights import Weights, checked

_NOT_SPLIT = (
    "This optimizer accumulates with micro_batch_size={size}: it splits Keras's own train step "
    "inside `model.fit` into micro-batches, but `apply_gradients` was called outside such a step "
    "(a model that overrides `train_step`, or a custom training loop), whose batch gradaccum cannot "
    "split. Accumulate across steps there: accumulate(optimizer, n=k) with batches of B / k."
)


class Core:
    """Gradient accumulation for one optimizer (see the module docstring).

    Args:
        family: The wrapped optimizer's family.
        settings: The accumulation's settings.
        backend: The active backend's hooks.
        on_built: Called with the state once it exists (persistence hooks
            it up: checkpoints, values loaded before it existed).

    Raises:
        ValueError: If the backend or the optimizer's library cannot take a setting.
    """

    def __init__(self, family: Any, settings: Settings, backend: Backend, on_built: Callable[[State], None]):
        backend.check_settings(settings)
        _micro_batches.check_family(settings, family)
        self.family = family
        self.settings = settings
        self.backend = backend
        self.cycle = Cycle(settings.n, backend)
        self.agc = _agc.clipping(settings.agc, settings.agc_eps, settings.agc_exclude)
        self.state: State | None = None
        self._on_built = on_built
        self.weights = Weights(backend, settings.weigh_by)
        self.auto_size: Any = None  # micro_batch_size="auto"'s search, made on first use (`_auto_size.search_of`)
        self.warned_undecided = False  # see `_cycle_end`: warned once
        # Whether any micro-batch was weighted (decided while tracing).
        self.weighted = False
        # The latest micro-step's extra `apply_gradients` arguments, for its cycle's update.
        self.options: Mapping[str, Any] = {}
        self._after_build: list[Callable[[], None]] = []  # see `when_built`
        self._followers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # see `follow`

    # Reading.

    @property
    def built(self) -> bool:
        return self.family.built and self.state is not None

    def current_n(self, checks: list[tuple[Callable[[], Any], str]] | None = None) -> Any:
        """`n` for the current cycle, as a backend integer tensor (`checks`: see `Cycle.current`)."""
        return self.cycle.current(self.family.iterations, checks)

    def micro_step(self) -> Any:
        """Micro-steps taken in the current cycle (a backend tensor)."""
        index = self.cycle.index  # where a deferring split step's loop counts them
        if self.state is None or index is not None:
            return ops.convert_to_tensor(0, dtype=self.backend.counter_dtype) if index is None else index
        return self.backend.snapshot(self.state.micro_step)

    def will_apply(self) -> Any:
        """Whether the next micro-step ends the cycle (a backend tensor)."""
        return ops.greater_equal(self.micro_step() + 1, self.current_n())

    def view(self) -> AccumulationState | None:
        """The state as `AccumulatingOptimizer.accumulation_state` shows it."""
        if self.state is None:
            return None
        view = self.state.view()
        n = self.state.position.n(self.cycle, self.family.iterations)
        return view if n is None else view._replace(n=n)

    def listed(self) -> list[Any]:
        """The state's variables the proxy lists in `variables`."""
        return [] if self.state is None else self.backend.listed(self.state)

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
        self.backend.check_build(self.family, self.settings.sparse)
        n = None if self.cycle.schedule is not None else self.cycle.value
        state = State(self.backend, self.family, variables, n, self.settings.accumulator_dtype)
        if self.settings.noise_scale:
            adaptive = self.cycle.value if isinstance(self.cycle.value, NoiseScaleSchedule) else None
            state.noise = Noise(self.backend, self.family, self.settings.noise_decay, adaptive)
            if adaptive is not None:
                self.cycle.follow(state.noise.next_n)
        self.cycle.attach(state.n)
        self.state = state
        self._on_built(state)
        waiting, self._after_build = self._after_build, []
        # Values loaded before the variables existed are assigned once, as a
        # restore would: eagerly, not as ops of a traced step.
        with self.backend.eagerly():
            for callback in waiting:
                callback()
        # A new state's position is 0, unless what waited loaded one.
        self.resync(counter=bool(waiting))

    def when_built(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once the optimizer and the state are built: at
        once if they are, else right after the state is built (eagerly, also
        while a step is traced), in the order given."""
        if self.built:
            callback()
        else:
            self._after_build.append(callback)

    def follow(self, follower: Any) -> None:
        """Makes `flush()` call `follower.flush()` too, while it lives."""
        self._followers[id(follower)] = follower

    # A micro-step.

    def step(
        self, grads: Sequence[Any], variables: Sequence[Any] | None, weight: Any, options: Mapping[str, Any]
    ) -> None:
        """Accumulates one micro-batch; applies if it completes the cycle.

        Raises:
            ValueError: See `AccumulatingOptimizer.apply`.
        """
        if self.settings.micro_batch_size is not None and self.cycle.split is None:
            raise ValueError(_NOT_SPLIT.format(size=self.settings.micro_batch_size))
        self.options = options
        weight, count = self.weights.take(weight)
        grads, variables = check_step_arguments(grads, variables, self.state.variables if self.built else None)
        if not grads:
            return
        check_gradient_shapes(grads, variables, self.weights.devices)
        if not self.built:
            self.build(variables)
        state = self.state
        state.load_restored_slices()
        indices = state.indices_of(variables)
        if all(g is None for g in grads):
            raise ValueError("No gradients provided for any variable (every gradient is None).")
        if self.cycle.hands_over() and weight is None and not state.took_part_ever:
            # Every micro-batch is a whole batch: hand the gradients over as
            # they are. Accumulating first would densify `IndexedSlices`
            # (summing repeated rows, which Keras applies one by one) and give
            # variables without a gradient zeros instead of skipping them.
            # (Once anything was accumulated, with another `n` set before,
            # the accumulating path below finishes that cycle instead.)
            traced = not self.backend.known(self.backend.read(state.micro_step))
            with self.cycle.hand_over_guard(traced):
                if self.agc is None:
                    # The plain optimizer, bit for bit (its own clipping included).
                    self.family.apply(grads, variables, options)
                else:
                    deliver(self, grads, variables, options)
            state.position.handed_over()
            return
        weight = count if weight is None else weight
        # In a graph, everything from reading the position on waits for the
        # gradients: a branch on a predicate that did not would start early.
        with self.backend.after(grads, variables, weight):
            checks = self.weights.checks()
            first, steps, ends = state.position.next(self.cycle, self.family.iterations, checks, self.cycle.index)
            with checked(self.backend, checks) as asserted:
                first, steps, ends, weight, grads = self.weights.refused_unless(
                    state, first, steps, ends, weight, grads, indices, asserted)
                ends = self.backend.ordered(ends)  # a merge call's branch waits for the checks too
                state.check_unmet(ends)
                with unchanged_if_raised(state, self.backend, ends):
                    took_part = self._add(grads, indices, weight, first)
                    if not self.cycle.deferred(took_part):  # else the update follows the split step's loop
                        state.position.mark(took_part, first, self.weights.accepted)
                        self._finish_if(ends, steps, took_part)

    def resync(self, counter: bool = True) -> None:
        """Takes the cycle's position from its variables (if `counter`)
        and, for a schedule, the applied-update count, where the backend
        keeps them on the host: after a build or a restore, not per
        micro-step."""
        if self.state is None:
            return
        schedule = self.cycle.schedule is not None
        self.state.position.resync(counter, self.family.iterations if schedule else None)
        if schedule:
            self.cycle.reread()

    def _add(self, grads: Sequence[Any], indices: Sequence[int], weight: Any, first: Any) -> set[int]:
        """Adds one micro-step's gradients; returns the positions that took part."""
        backend, state = self.backend, self.state
        if weight is not None:
            self.weighted = True
            if not isinstance(weight, float):
                weight = ops.cast(weight, "float32")
        took_part = set()
        measured = []  # the gradients whose norm the noise scale takes: not a maximum's
        # One group per way of adding (`State.group`), each one backend call.
        groups: dict[str, tuple[list[int], list[Any]]] = {group: ([], []) for group in GROUPS}
        for g, i in zip(grads, indices):
            if g is None:
                continue
            group = state.group(i, backend.gradients.is_slices(g), self.settings.sparse)
            groups[group][0].append(i)
            groups[group][1].append(g)
            if group != MAXIMUM:
                measured.append(g)
            took_part.add(i)
            state.took_part_ever.add(i)

        def held(group: str) -> list[Any]:
            return [state.accumulators[i] for i in groups[group][0]]

        backend.tensors.add_into(held(SUM), groups[SUM][1], weight, first)
        # A weight scales a contribution to a mean or a sum; a maximum has none to scale.
        backend.tensors.max_into(held(MAXIMUM), groups[MAXIMUM][1], first)
        compensations = [state.compensations[i] for i in groups[COMPENSATED][0]]
        _compensated.add(backend, held(COMPENSATED), compensations, groups[COMPENSATED][1], weight, first)
        if groups[SCATTERED][0]:
            backend.scatter_into(held(SCATTERED), groups[SCATTERED][1], weight, first)
        if groups[SLICES][0]:
            kept = [state.kept_for(i, self.settings.sparse == "slices") for i in groups[SLICES][0]]
            self.weights.if_accepted(backend.keep_slices, kept, groups[SLICES][1], weight, first)
        if state.noise is not None:
            state.noise.add(measured, weight, first)
        if first is not False:  # False: a later micro-step known on the host
            # Every other accumulator: the last cycle's sums must not count in
            # this one. Not only those of variables that took part when this step
            # was traced: others may have taken part in another trace since.
            missing = [a for i, a in enumerate(state.accumulators) if i not in took_part and not state.keeps_slices(i)]
            missing += [c for i, kept in state.kept.items() if i not in took_part for c in backend.kept_counters(kept)]
            missing += [c for i, c in enumerate(state.compensations or []) if i not in took_part]
            backend.tensors.zero_if(first, missing)
        backend.tensors.add_scalar(state.weight_total, 1.0 if weight is None else weight, first)
        return took_part

    def flush(self) -> None:
        """Applies what the current cycle holds now, if anything: the
        (weighted) mean over the micro-batches actually accumulated."""
        for follower in list(self._followers.values()):
            follower.flush()
        state = self.state
        if state is None or not state.took_part_ever:
            return
        state.load_restored_slices()
        self.backend.replicas.on_each(self.family, self._flush_here)

    def _flush_here(self) -> None:
        pending = self.state.position.pending()
        if pending is None:
            return  # an empty cycle
        steps, ends = pending
        self.state.check_unmet(ends)
        with unchanged_if_raised(self.state, self.backend, ends):
            self._finish_if(ends, steps, None)

    # The end of a cycle.

    def _finish_if(self, ends: Any, steps: Any, took_part: set[int] | None) -> None:
        """Runs the cycle's update, kept only if `ends`; then resets the
        micro-step counter (if `ends`) or sets it to `steps`. `took_part`: the
        positions that took part in this micro-step (None for `flush`)."""
        backend, state = self.backend, self.state
        # An in-between step known as one (on the host, eagerly) runs no
        # update, which could fail after its gradients were added.
        if not backend.known(ends) or bool(ends):
            end_cycle(self, ends, steps, took_part)
        state.position.advance(ends, steps)
