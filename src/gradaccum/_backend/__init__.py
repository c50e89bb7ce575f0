"""The backend seam: the few things the core does differently per Keras backend.

The core (`gradaccum._core`) decides *what* a micro-step does, once for every
backend; a backend says *how*, through the hooks of `Backend` below, its
groups (`Tensors`, `Replicas`, `Gradients`: one Keras-ops implementation
each, overridden where a backend must), the optional `KeptSlices`, and the
cycle's `position.Position`. There are three backends:

- `tensorflow.TensorFlowBackend` (`tensorflow/backend.py`): TensorFlow
  variables placed for `tf.distribute` (replica-local accumulators, counters
  every replica advances alike), adds and branches written for TensorFlow's
  graphs and XLA, `tf.IndexedSlices`, and the two ways to run the wrapped
  optimizer's update: masked (branch-free around anything that synchronises
  replicas) or skipped (a branch decided in cross-replica context).
- `keras_ops.KerasOpsBackend` (`keras_ops.py`), for JAX, written with Keras
  ops: `keras.Variable`s that travel in the optimizer's `variables`, and
  `jax.lax.cond` where JAX traces; under a `keras.distribution` that splits
  the batch, device-local accumulators (`device_local.py`).
- `pytorch.TorchBackend` (`pytorch.py`), its subclass for PyTorch: in-place,
  fused multi-tensor writes, and the cycle's position kept on the host, so
  that a micro-step reads nothing back from the device.

Importing this package imports no backend: on JAX and PyTorch TensorFlow
need not be installed. `check_supported()` refuses a backend that cannot
train; `for_active()` gives the hooks of the active one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import keras

# The modules above run their entry points through `_backend.unconverted`.
from gradaccum._backend.as_written import unconverted as unconverted

SUPPORTED = ("tensorflow", "jax", "torch")


def active() -> str:
    """The name of the active Keras backend."""
    return keras.config.backend()


def check_supported() -> None:
    """Raises if the active Keras backend is not one gradaccum runs on.

    Raises:
        ValueError: Naming the active backend and the supported ones.
    """
    backend = active()
    if backend not in SUPPORTED:
        raise ValueError(
            f"gradaccum runs on Keras's {', '.join(SUPPORTED)} backends; the "
            f"active Keras backend is {backend!r}, which cannot train. Set "
            "KERAS_BACKEND to one of those."
        )


class StateVariables(NamedTuple):
    """The variables a backend creates for one optimizer's accumulation.

    Attributes:
        accumulators: One per variable, float32 or bfloat16 (float64 for
            float64 variables), zeros.
        micro_step: The integer micro-step counter, 0.
        weight_total: The float32 sum of the cycle's micro-batch weights, 0.
        n: The cycle's length for an int `n` (so that setting it needs no
            new trace), or None for a schedule.
        took_part: An integer vector, whether each variable took part in the
            current cycle (1 at first), where kept in a variable; else None.
    """

    accumulators: list[Any]
    micro_step: Any
    weight_total: Any
    n: Any
    took_part: Any = None


class Update(NamedTuple):
    """A cycle's update, as the core hands it to `Backend.finish`.

    Attributes:
        ends: Scalar boolean: this micro-step ends the cycle (the update is
            kept only then).
        accumulators: The accumulators of the variables that took part in the cycle.
        divided: For each, whether the mean divides it (False for a
            maximum, see `gradaccum._core`).
        divisor: The mean's scalar divisor, or None for `"sum"`.
        apply: Runs the wrapped optimizer's update, given each
            accumulator's (divided) value; a backend may hand it a
            `masking` too, which reaches the family's `apply` (on
            TensorFlow: when the update's writes take effect).
        family: The wrapped optimizer's family.
        variables: Every variable the optimizer is built for.
        took_part: The variables of `accumulators`.
        conditions: For some of the update's variables (by position in
            `accumulators`), a function returning a scalar boolean: whether
            the variable took part in this cycle; where it did
            not, neither it nor its optimizer state may change (see
            `Backend.masks_each`).
    """

    ends: Any
    accumulators: list[Any]
    divided: list[bool]
    divisor: Any
    apply: Callable[[list[Any]], None]
    family: Any
    variables: list[Any]
    took_part: list[Any] = []
    conditions: dict[int, Callable[[], Any]] = {}


class Tensors(Protocol):
    """The tensor work of a micro-step: sums, maxima, norms, zeroing and
    run-time assertions. Written once in Keras ops (`tensors.KerasOpsTensors`);
    PyTorch's writes in place, all variables in one multi-tensor operation,
    and TensorFlow's is written for its graphs, XLA and replica-local
    variables. `first`: whether the micro-step is its cycle's first."""

    def add_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        """`acc += weight * grad` (`grad` for `weight=None`) for each pair;
        on a cycle's first micro-step (`first`) writes it over `acc`."""

    def max_into(self, accumulators: Sequence[Any], values: Sequence[Any], first: Any) -> None:
        """`acc = maximum(acc, value)` for each pair, or `value` on a
        cycle's first micro-step."""

    def add_scalar(self, total: Any, value: Any, first: Any) -> None:
        """`total += value`, or `value` on a cycle's first micro-step."""

    def squared_norm(self, values: Sequence[Any]) -> Any:
        """The float32 scalar sum of squares of every element of `values`
        (gradients or accumulators; a sparse gradient's values)."""

    def add_squared_norm(self, total: Any, values: Sequence[Any], weight: Any, first: Any) -> None:
        """`total += weight * squared_norm(values)` (`weight=None`: 1), or
        that product on a cycle's first micro-step (`first`)."""

    def zero_if(self, condition: Any, variables: Sequence[Any]) -> None:
        """Zeroes `variables` if the scalar `condition` holds."""

    def any_nonzero(self, variables: Sequence[Any]) -> Any:
        """Scalar boolean: some element of some of `variables` is not 0."""

    def assert_that(self, condition: Callable[[], Any], message: str) -> Any:
        """In a traced step, a run-time assertion of `condition()`, where the
        backend has one (not JAX; TensorFlow's, which XLA drops, not under
        XLA; PyTorch's, on the device, also eagerly); else nothing."""

    def guarded(self, condition: Callable[[], Any], message: str) -> contextlib.AbstractContextManager[bool]:
        """Within the block, ops of a traced step run only where
        `condition()` holds at run time (an assertion), where the backend
        has one; else nothing. Yields whether it has one."""


class Replicas(Protocol):
    """Distribution (one replica on a backend without `tf.distribute`), and
    what the optimizer families ask of it."""

    def count(self) -> int:
        """Replicas taking part in the current replica context."""

    def index(self) -> int:
        """This replica's index (0 outside replica context)."""

    def sum(self, values: Any) -> Any:
        """All-reduces `values` by summation across replicas."""

    def clip_as_one_device(self, grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Clips the replicas' summed gradient with `clip`, and hands each
        replica its share of the result."""

    def on_each(self, family: Any, fn: Callable[[], None]) -> None:
        """Runs `fn` once per replica (from wherever it is called)."""

    def strategy_of(self, optimizer: Any) -> Any:
        """The `tf.distribute` strategy `optimizer` was created under (else
        the current one); None on a backend without `tf.distribute`."""

    def check_buildable(self, family: Any) -> None:
        """Raises if the wrapped optimizer cannot create its state here
        (under a strategy not its own, or traced on one of several replicas)."""

    def native(self, variable: Any) -> Any:
        """The variable behind a Keras variable that the backend's hooks
        place and write (TensorFlow's `tf.Variable`); else `variable`."""

    def apply_masked(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], masking: Any) -> None:
        """A Keras 3 optimizer's `apply`, its writes taking effect only as
        `masking` says (which only TensorFlow's `finish` hands over)."""

    def local_axis(self) -> tuple[Any, str | None]:
        """The mesh axis the accumulators are device-local over while the
        batch is split over it (`device_local`), or `(None, why not)`."""

    def local_devices(self, accumulator: Any) -> int:
        """The devices a device-local accumulator has an entry for, else 0."""


class Gradients(Protocol):
    """Gradients and losses as the core and the layers above it see them
    (`gradients.KerasOpsGradients`: every gradient dense, every shape known)."""

    def is_slices(self, grad: Any) -> bool:
        """Whether `grad` is a sparse gradient (only TensorFlow has them,
        `tf.IndexedSlices`; its backend also gives the hooks of `KeptSlices`)."""

    def densify(self, grad: Any) -> Any:
        """`grad` as a dense tensor (a sparse gradient's rows summed)."""

    def scale_gradient(self, grad: Any, factor: Any) -> Any:
        """`grad * factor` in `grad`'s dtype; a sparse gradient stays sparse
        (`factor` then multiplies its rows' values)."""

    def shape_and_entries(self, values: Any, weight: Any) -> tuple[tuple[int | None, ...] | None, Any]:
        """The shape of `values * weight` (of `values` for `weight=None`)
        as far as known here (None if its rank is not), and its number of
        entries as a float32 scalar tensor (known at run time)."""

    def usable_here(self, value: Any) -> bool:
        """Whether a value handed over from an earlier call (a loss count)
        belongs to the trace (or eager run) running now."""

    def no_op(self) -> Any:
        """What a write that does nothing returns (`read_value=False`)."""

    def delegate_tracking(self, optimizer: Any, inner: Any) -> None:
        """Points the checkpoint tracking of a loss-scale `optimizer` that
        hands it to the inner optimizer it was created with (tf_keras's, for
        OptimizerV2) at `inner`; nothing for any other."""


class Backend(Protocol):
    """The hooks a backend gives the core: the state, reading and writing
    it, and running a step; the tensor work, distribution and gradients in
    groups of their own."""

    # The dtype of the micro-step counter and of `n`.
    counter_dtype: str
    # Whether a micro-step may read a value into Python (not on PyTorch: it waits for the device).
    reads_back: bool
    tensors: Tensors
    replicas: Replicas
    gradients: Gradients

    # The state.

    def create_state(
        self, family: Any, variables: Sequence[Any], n: int | None, dtype: str = "float32"
    ) -> StateVariables:
        """Creates the accumulation state's variables, zeros (`n`: see
        `StateVariables`; `dtype`: see `new_accumulators`)."""

    def new_accumulators(self, family: Any, variables: Sequence[Any], dtype: str = "float32") -> list[Any]:
        """Zero accumulators for `variables` (an optimizer that grows, or
        compensations): of `dtype` (`"float32"` or `"bfloat16"`), except
        float64 for float64 variables and float32 for those that keep a
        maximum."""

    def scalar_variable(self, family: Any, name: str) -> Any:
        """A float32 scalar variable, 0, each replica's own (read as the sum
        over replicas), placed as the accumulation state is."""

    def position(self, counter: Any, flags: Any) -> Any:
        """The cycle's `position.Position`, in `counter` and `flags` (`StateVariables`) or on the host."""

    def listed(self, state: Any) -> list[Any]:
        """The state's variables the proxy lists in the optimizer's
        `variables` (JAX's `fit` carries only those from step to step)."""

    def check_settings(self, settings: Any) -> None:
        """Raises for a setting this backend cannot take."""

    def check_build(self, family: Any, sparse: str) -> None:
        """Raises if the state cannot be built here (while traced, say)."""

    # Reading and writing it.

    def known(self, value: Any) -> bool:
        """Whether `value`'s value can be read in Python here (not traced)."""

    def read(self, variable: Any) -> Any:
        """The variable's current value (may share its buffer)."""

    def snapshot(self, variable: Any) -> Any:
        """The variable's current value, unchanged by later writes."""

    def eagerly(self) -> contextlib.AbstractContextManager[None]:
        """Runs the block outside any trace (values loaded into variables
        that did not exist when a step was traced)."""

    def writable_now(self, variable: Any) -> bool:
        """Whether a write to `variable` now lasts (eager, not traced nor in
        a stateless scope)."""

    def saved(self, variable: Any, maximum: bool) -> Any:
        """The variable's value as a NumPy array, as files hold it: the sum
        over replicas, or their maximum for a maximum."""

    def load(self, variable: Any, value: Any, maximum: bool) -> None:
        """Writes a value `saved` returned back (a sum split among replicas)."""

    def assign(self, variable: Any, value: Any) -> None:
        """Writes `value` (a tensor, or a Python number) to `variable`."""

    # Running a step.

    def after(self, grads: Sequence[Any], variables: Sequence[Any], weight: Any
              ) -> contextlib.AbstractContextManager[None]:
        """Within the block, the ops of a traced step run only once every
        gradient of `grads` (None: none) and `weight` (if a tensor) are
        computed, and each gradient is known to have its variable's shape
        (of `variables`), so that a failure computing them (an assertion in
        the loss, a shape the trace left unknown) stops the step before it
        writes anything. Nothing where ops run in program order (eagerly,
        JAX, PyTorch)."""

    def ordered(self, value: Any) -> Any:
        """`value`, made to wait for what the block waits for (`after`, `guarded`), also across a merge call."""

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        """Runs `fn`, which synchronises nothing, only if `condition`;
        `writes`: the variables `fn` writes (a traced branch on JAX returns
        their new values)."""

    def finish(self, update: Update, mode: str) -> None:
        """Runs `update.apply` so that it takes effect only if `update.ends`
        (`mode`: `"masked"` or `"skip"`, where the backend tells them apart)."""

    def masks_each(self, family: Any) -> bool:
        """Whether `finish` honours `Update.conditions` for this family."""


@runtime_checkable
class KeptSlices(Protocol):
    """The hooks of a backend with sparse gradients (TensorFlow's alone):
    a variable's slices kept as slices for a cycle. The core asks for them
    only where `Gradients.is_slices` said a gradient is sparse; elsewhere
    `isinstance(backend, KeptSlices)` tells whether slices can be kept."""

    def scatter_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        """Adds each sparse `grad` (times `weight`) into the rows of its
        accumulator, zeroed first on a cycle's first micro-step (`first`)."""

    def new_kept(self, family: Any, variable: Any, accumulator: Any, n: Any, keep_all: bool,
                 steps: Callable[[], int]) -> Any:
        """A variable's kept slices, empty (`keep_all`: every slice grows;
        `steps`: the cycle's micro-steps so far, read eagerly)."""

    def keep_slices(self, kept: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        """Keeps each sparse `grad` (times `weight`) in its variable's `kept`."""

    def kept_slices(self, kept: Any, divisor: Any) -> Any:
        """The cycle's kept slices as one sparse gradient for the optimizer,
        divided by `divisor` (None: undivided); None where they were added
        into rows."""

    def kept_local(self, kept: Any) -> Any:
        """This replica's own kept slices, undivided (no all-reduce)."""

    def kept_counters(self, kept: Any) -> list[Any]:
        """The variables of `kept` that a cycle's first micro-step giving
        its variable no gradient zeroes."""

    def kept_saved(self, kept: Any) -> Callable[[], None]:
        """The slices `kept` holds now (eagerly), and how to put them back
        where the step ending their cycle raises: in a replica context,
        those this replica's restore must write."""


def for_active() -> Backend:
    """The hooks of the active Keras backend.

    Raises:
        ValueError: If the active backend cannot train (numpy, openvino).
    """
    check_supported()
    if active() == "tensorflow":
        from gradaccum._backend.tensorflow.backend import TensorFlowBackend

        return TensorFlowBackend()
    if active() == "torch":
        from gradaccum._backend.pytorch import TorchBackend

        return TorchBackend()
    from gradaccum._backend.keras_ops import KerasOpsBackend

    return KerasOpsBackend()

