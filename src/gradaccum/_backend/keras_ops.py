"""The hooks on JAX (and the base of PyTorch's), where optimizers run on Keras ops.

On JAX, `model.fit` and `optimizer.stateless_apply` run the optimizer inside
a `StatelessScope`, usually traced by `jax.jit`: a variable's write is
recorded by the scope, a branch on a traced value is a `jax.lax.cond` of pure
functions, and the state must be among the optimizer's `variables` to travel
from step to step. PyTorch (`gradaccum._backend.pytorch`) runs eagerly and
writes in place. Neither has `tf.distribute`, so `mode` changes nothing
here: the update runs only on the step that ends a cycle. Under a JAX
`keras.distribution` the accumulators may be device-local
(`gradaccum._backend.device_local`): each device adds its own gradients, and
the update sums the devices' entries, the cycle's one all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope, in_stateless_scope

from gradaccum._backend import StateVariables, Update, device_local, gradients, position
from gradaccum._backend.tensors import KerasOpsTensors, OneReplica, is_traced


def accumulator_dtype(variable: Any, dtype: str = "float32") -> str:
    """`dtype` (float32 unless `accumulator_dtype` says otherwise: sums of
    float16 or bfloat16 micro-gradients would round at every micro-step),
    float64 for a float64 variable, float32 for one that keeps a maximum."""
    if keras.backend.standardize_dtype(variable.dtype) == "float64":
        return "float64"
    return "float32" if getattr(variable, "overwrite_with_gradient", False) else dtype


def _variable(name: str, shape: Any, dtype: str, value: Any = 0) -> keras.Variable:
    return keras.Variable(
        np.full(shape, value, dtype=dtype), dtype=dtype, trainable=False, name=f"gradaccum_{name}"
    )


def quotient(value: Any, divisor: Any) -> Any:
    """`value / divisor` for a scalar `divisor`, as an elementwise division.

    Run eagerly, the divisor is broadcast first: XLA turns a division by a
    scalar into a multiplication by its reciprocal, which rounds differently
    from the division TensorFlow, PyTorch and NumPy do. Inside `jax.jit` it
    does so either way, and there a broadcast divisor would cost a tensor of
    the value's size, so there the scalar is divided by as it is.
    """
    divisor = ops.cast(divisor, value.dtype)
    if is_traced(value):
        return value / divisor
    return value / ops.broadcast_to(divisor, ops.shape(value))


def run_if(condition: Any, fn: Callable[[], None], variables: Sequence[Any]) -> None:
    """Runs `fn` (which writes some of `variables`) only if `condition`.

    Where `condition` is known this is Python's `if`. Traced by JAX, it is a
    `jax.lax.cond` whose taken branch runs `fn` in a `StatelessScope` over
    the values of `variables` and returns their new values, and whose other
    branch returns them unchanged; those values are then written to
    `variables`. Everything `fn` writes must be among `variables`.
    """
    if not is_traced(condition):
        if bool(condition):
            fn()
        return
    import jax

    variables = list(variables)
    # Inside the branch, variables it does not write read as the enclosing
    # scope has them (`fit`'s values of this step), not as stored.
    outer = get_stateless_scope() if in_stateless_scope() else None

    def taken(values: list[Any]) -> list[Any]:
        with StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            if outer is not None:
                for key, value in outer.state_mapping.items():
                    scope.state_mapping.setdefault(key, value)
            fn()
        return [scope.get_current_value(v) for v in variables]

    values = jax.lax.cond(condition, taken, lambda values: list(values), [v.value for v in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)


class KerasOpsBackend:
    """The hooks of `gradaccum._backend.Backend` with Keras ops (JAX)."""

    counter_dtype = "int32"
    reads_back = True

    def __init__(self) -> None:
        # Device-local accumulators (by id): their number of devices.
        self.local: dict[int, int] = {}
        # Why the accumulators are not device-local under a distribution.
        self.why_not_local: str | None = None
        self._axis: device_local.DataAxis | None = None
        self._global_only: str | None = None
        self.tensors = KerasOpsTensors(self.local)
        self.replicas = DeviceLocalReplicas(self)
        self.gradients = gradients.KerasOpsGradients()

    # State.

    def create_state(
        self, family: Any, variables: Sequence[Any], n: int | None, dtype: str = "float32"
    ) -> StateVariables:
        return StateVariables(
            accumulators=self.new_accumulators(family, variables, dtype),
            micro_step=_variable("micro_step", (), "int32"),
            weight_total=_variable("weight_total", (), "float32"),
            n=None if n is None else _variable("n", (), "int32", n),
            took_part=_variable("touched", (len(variables),), "int32", 1),
        )

    def new_accumulators(self, family: Any, variables: Sequence[Any], dtype: str = "float32") -> list[Any]:
        # No family here grows (see `OptimizerFamily.grows`): this makes them all.
        layouts = self._local_layouts(variables, dtype)
        if layouts is None:
            return [
                _variable(f"accumulator_{i}", tuple(v.shape), accumulator_dtype(v, dtype))
                for i, v in enumerate(variables)
            ]
        size = self._axis.size
        made = []
        for i, (v, layout) in enumerate(zip(variables, layouts)):
            held = accumulator_dtype(v)
            accumulator = keras.Variable(
                np.zeros((size, *v.shape), held), dtype=held, trainable=False, name=f"gradaccum_accumulator_{i}",
                layout=layout,
            )
            self.local[id(accumulator)] = size
            made.append(accumulator)
        return made

    def _local_layouts(self, variables: Sequence[Any], dtype: str) -> list[Any] | None:
        """Each accumulator's device-local layout, or None (all or none: the
        train step computes every gradient per device, or none)."""
        axis, self.why_not_local = device_local.data_axis()
        self._axis = axis
        if axis is None:
            return None
        if dtype != "float32":
            self.why_not_local = f"accumulator_dtype={dtype!r} keeps compensations that are not device-local"
            return None
        if self._global_only is not None:
            self.why_not_local = self._global_only
            return None
        layouts = []
        for v in variables:
            if getattr(v, "overwrite_with_gradient", False):
                self.why_not_local = f"variable {v.path!r} keeps the maximum of its gradients, not a sum"
                return None
            layout, self.why_not_local = device_local.stacked_layout(v, axis)
            if layout is None:
                return None
            layouts.append(layout)
        return layouts

    def position(self, counter: Any, flags: Any) -> position.Position:
        return position.DevicePosition(self, counter, flags)

    def listed(self, state: Any) -> list[Any]:
        own = [*state.accumulators, state.micro_step, state.weight_total]
        own += [v for v in (state.n, state.took_part) if v is not None]
        if state.compensations is not None:
            own += state.compensations
        if state.noise is not None:
            own += state.noise.variables()
        return own

    def check_settings(self, settings: Any) -> None:
        # Embedding gradients are dense here: "auto" adds them into rows,
        # which is what the large batch does.
        if settings.sparse == "slices":
            raise ValueError(
                f"sparse={settings.sparse!r} keeps `tf.IndexedSlices`, which only the "
                f"TensorFlow backend has; the active Keras backend is "
                f"{keras.config.backend()!r}. Use sparse=\"auto\" (the default) or \"rows\"."
            )
        # The noise scale takes each micro-batch's whole gradient, which
        # device-local accumulators never see.
        self._global_only = None
        if settings.noise_scale:
            self._global_only = "noise_scale=True measures each micro-batch's whole gradient"

    def check_build(self, family: Any, sparse: str) -> None:
        if is_traced(family.iterations.value):
            raise ValueError(
                "The accumulating optimizer must be built before it is traced "
                "by `jax.jit`: call `optimizer.build(model.trainable_variables)` "
                "first (`model.fit` does)."
            )

    # Reading.

    def known(self, value: Any) -> bool:
        return not is_traced(value)

    def read(self, variable: Any) -> Any:
        return variable.value

    def snapshot(self, variable: Any) -> Any:
        return variable.value

    def eagerly(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def writable_now(self, variable: Any) -> bool:
        return not in_stateless_scope() and not is_traced(variable.value)

    def saved(self, variable: Any, maximum: bool) -> np.ndarray:
        value = np.asarray(ops.convert_to_numpy(variable))
        return value.sum(axis=0) if id(variable) in self.local else value

    def load(self, variable: Any, value: np.ndarray, maximum: bool) -> None:
        size = self.local.get(id(variable))
        variable.assign(value if size is None else device_local.stacked(value, size))

    # A micro-step.

    def after(self, grads: Sequence[Any], variables: Sequence[Any], weight: Any) -> Any:
        return contextlib.nullcontext()  # JAX orders writes by their inputs; PyTorch runs in order

    def ordered(self, value: Any) -> Any:
        return value

    def scalar_variable(self, family: Any, name: str) -> Any:
        return _variable(name, (), "float32")

    def assign(self, variable: Any, value: Any) -> None:
        variable.assign(value)

    def masks_each(self, family: Any) -> bool:
        return False

    def finish(self, update: Update, mode: str) -> None:
        accumulators, divided, divisor = update.accumulators, update.divided, update.divisor
        if not is_traced(update.ends):
            # Outside `jit` whether the cycle ends is known before the update
            # would run, so the update runs on apply steps only, and the
            # accumulators are divided in place (no second copy of the sums
            # while the update runs).
            if bool(update.ends):
                update.apply([
                    self._divide_in_place(a, divisor) if d and divisor is not None else self._total(a, a.value)
                    for a, d in zip(accumulators, divided)
                ])
            return
        # Read here: the branch below sees only the variables it writes.
        # Device-local ones are summed inside it, so that their all-reduce
        # runs only on the step that ends the cycle.
        sums = [a.value for a in accumulators]
        family = update.family
        model = list(family.trainable_variables())
        known = {id(m) for m in model}
        watched = model + [v for v in family.state_variables() if id(v) not in known]

        def apply() -> None:
            totals = [self._total(a, s) for a, s in zip(accumulators, sums)]
            update.apply([
                quotient(s, divisor) if d and divisor is not None else s for s, d in zip(totals, divided)
            ])

        # Traced by JAX, both modes run the update in a `jax.lax.cond`: a
        # select between the update's new values and the old ones would run
        # the update on every micro-step, and cost XLA on the CPU several
        # times the update itself.
        run_if(update.ends, apply, watched)

    def _total(self, accumulator: Any, value: Any) -> Any:
        """The sum over devices of a device-local accumulator's `value` (the
        all-reduce); `value` itself for any other."""
        return ops.sum(value, axis=0) if id(accumulator) in self.local else value

    def _divide_in_place(self, accumulator: Any, divisor: Any) -> Any:
        if id(accumulator) in self.local:
            return quotient(self._total(accumulator, accumulator.value), divisor)
        accumulator.assign(quotient(accumulator.value, divisor))
        return accumulator.value

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        if is_traced(condition):
            run_if(condition, fn, writes)
        elif bool(condition):
            fn()


class DeviceLocalReplicas(OneReplica):
    """One replica (no `tf.distribute`), with the device-local accumulators
    `backend` made under a JAX `keras.distribution` (`device_local`)."""

    def __init__(self, backend: KerasOpsBackend):
        self._backend = backend

    def local_axis(self) -> tuple[device_local.DataAxis | None, str | None]:
        backend = self._backend
        if not backend.local or backend._axis is None:
            return None, backend.why_not_local
        axis, _ = device_local.data_axis()
        same = axis is not None and (axis.name, axis.size) == (backend._axis.name, backend._axis.size)
        return (axis if same else None), None

    def local_devices(self, accumulator: Any) -> int:
        return self._backend.local.get(id(accumulator), 0)
