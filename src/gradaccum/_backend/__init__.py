"""The backend seam: the few things the core does differently per Keras backend.

The core (`gradaccum._core`) decides *what* a micro-step does, once for every
backend; a backend says *how*, through the hooks of `Backend` below. There
are three:

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
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import keras

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


_F = TypeVar("_F", bound=Callable[..., Any])


def unconverted(method: _F) -> _F:
    """Runs `method` as it is written: never converted by TensorFlow's
    AutoGraph, never traced by `torch.compile`.

    A `tf.function` converts the Python functions it calls, unless they are
    Keras's or TensorFlow's, so a custom loop would convert the accumulation,
    which writes every branch itself, where `fit` (Keras's code calling it)
    does not. So it runs unconverted everywhere, and so do the branches and
    merge calls it makes.

    `torch.compile` (`jit_compile=True` on PyTorch) traces Python into a graph
    that keeps the tensor work and drops or freezes the rest: the cycle's
    position kept on the host, a loss count handed to the optimizer, and any
    attribute of the proxy it cannot look up (wrapt's proxy is a C type), read
    as absent. So on PyTorch it runs between the compiled graphs.
    """
    eager: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = active()
        if backend == "tensorflow":
            import tensorflow as tf

            return tf.autograph.experimental.do_not_convert(method)(*args, **kwargs)
        if backend == "torch":
            import torch

            if torch.compiler.is_compiling():
                if not eager:
                    eager.append(torch.compiler.disable(method))
                return eager[0](*args, **kwargs)
        return method(*args, **kwargs)

    return call  # type: ignore[return-value]


class StateVariables(NamedTuple):
    """The variables a backend creates for one optimizer's accumulation.

    Attributes:
        accumulators: One per variable, float32 or bfloat16 (float64 for
            float64 variables), zeros.
        micro_step: The integer micro-step counter, 0.
        weight_total: The float32 sum of the cycle's micro-batch weights, 0.
        n: The cycle's length for an int `n` (so that setting it needs no
            new trace), or None for a schedule.
        touched: Where the backend keeps it as a variable, an integer vector:
            whether each variable has received a gradient in the current
            cycle (1 at first, as if every variable had); else None.
    """

    accumulators: list[Any]
    micro_step: Any
    weight_total: Any
    n: Any
    touched: Any = None


class Update(NamedTuple):
    """A cycle's update, as the core hands it to `Backend.finish`.

    Attributes:
        ends: Scalar boolean: this micro-step ends the cycle (the update is
            kept only then).
        accumulators: The accumulators of the variables taking part.
        divided: For each, whether the mean divides it (False for a
            maximum, see `gradaccum._core`).
        divisor: The mean's scalar divisor, or None for `"sum"`.
        apply: Runs the wrapped optimizer's update, given each
            accumulator's (divided) value; a backend may hand it a
            `masking` too, which reaches the family's `apply` (on
            TensorFlow: when the update's writes take effect).
        family: The wrapped optimizer's family.
        variables: Every variable the optimizer is built for.
        taking_part: The variables of `accumulators`.
        conditions: For some of the update's variables (by position in
            `accumulators`), a function returning a scalar boolean: whether
            the variable has received a gradient in this cycle; where it has
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
    taking_part: list[Any] = []
    conditions: dict[int, Callable[[], Any]] = {}


class Backend(Protocol):
    """The hooks a backend gives the core."""

    # The dtype of the micro-step counter and of `n`.
    counter_dtype: str
    # Whether the cycle's position is kept on the host (Python integers: the hooks
    # get Python booleans; the counter is written, never read, per micro-step).
    host_counters: bool

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

    def listed(self, state: Any) -> list[Any]:
        """The state's variables the proxy lists in the optimizer's
        `variables` (JAX's `fit` carries only those from step to step)."""

    def check_settings(self, settings: Any) -> None:
        """Raises for a setting this backend cannot take."""

    def check_build(self, family: Any, sparse: str) -> None:
        """Raises if the state cannot be built here (while traced, say)."""

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

    def add_into(self, accumulators: Sequence[Any], grads: Sequence[Any], weight: Any, first: Any) -> None:
        """`acc += weight * grad` (`grad` for `weight=None`) for each pair;
        on a cycle's first micro-step (`first`) writes it over `acc`."""

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

    def max_into(self, accumulator: Any, value: Any, first: Any) -> None:
        """`acc = maximum(acc, value)`, or `value` on a cycle's first
        micro-step."""

    def add_scalar(self, total: Any, value: Any, first: Any) -> None:
        """`total += value`, or `value` on a cycle's first micro-step."""

    def scalar_variable(self, family: Any, name: str) -> Any:
        """A float32 scalar variable, 0, each replica's own (read as the sum
        over replicas), placed as the accumulation state is."""

    def squared_norm(self, values: Sequence[Any]) -> Any:
        """The float32 scalar sum of squares of every element of `values`
        (gradients or accumulators; a sparse gradient's values)."""

    def add_squared_norm(self, total: Any, values: Sequence[Any], weight: Any, first: Any) -> None:
        """`total += weight * squared_norm(values)` (`weight=None`: 1), or
        that product on a cycle's first micro-step (`first`)."""

    def zero_if(self, condition: Any, variables: Sequence[Any]) -> None:
        """Zeroes `variables` if the scalar `condition` holds."""

    def assign(self, variable: Any, value: Any) -> None:
        """Writes `value` to `variable`."""

    def set_counter(self, variable: Any, value: int) -> None:
        """Writes the Python integer `value` to an integer variable."""

    def finish(self, update: Update, mode: str) -> None:
        """Runs `update.apply` so that it takes effect only if `update.ends`
        (`mode`: `"masked"` or `"skip"`, where the backend tells them apart)."""

    def masks_each(self, family: Any) -> bool:
        """Whether `finish` honours `Update.conditions` for this family."""

    def when(self, condition: Any, fn: Callable[[], None], writes: Sequence[Any] = ()) -> None:
        """Runs `fn`, which synchronises nothing, only if `condition`;
        `writes`: the variables `fn` writes (a traced branch on JAX returns
        their new values)."""

    def assert_that(self, condition: Callable[[], Any], message: str) -> Any:
        """In a traced step, a run-time assertion of `condition()`, where the
        backend has one (not JAX; TensorFlow's, which XLA drops, not under
        XLA); else nothing."""

    def any_nonzero(self, variables: Sequence[Any]) -> Any:
        """Scalar boolean: some element of some of `variables` is not 0."""

    def guarded(self, condition: Callable[[], Any], message: str) -> contextlib.AbstractContextManager[None]:
        """Within the block, ops of a traced step run only where
        `condition()` holds at run time (an assertion), where the backend
        has one; else nothing."""

    # Distribution: one replica on a backend without `tf.distribute`.

    def replicas(self) -> int:
        """Replicas taking part in the current replica context."""

    def replica_id(self) -> int:
        """This replica's index (0 outside replica context)."""

    def sum_over_replicas(self, values: Any) -> Any:
        """All-reduces `values` by summation across replicas."""

    def clip_as_one_device(self, grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Clips the replicas' summed gradient with `clip`, and hands each
        replica its share of the result."""

    def on_each_replica(self, family: Any, fn: Callable[[], None]) -> None:
        """Runs `fn` once per replica (from wherever it is called)."""

    def usable_here(self, value: Any) -> bool:
        """Whether a value handed over from an earlier call belongs to the
        trace (or eager run) running now."""

    # Sparse gradients: only TensorFlow has them (`tf.IndexedSlices`); a
    # backend that has them also gives the hooks of `KeptSlices`.

    def is_slices(self, grad: Any) -> bool:
        """Whether `grad` is a sparse gradient."""

    # Gradients and losses as the layers above the core see them (`gradients`).

    def densify(self, grad: Any) -> Any:
        """`grad` as a dense tensor (a sparse gradient's rows summed)."""

    def scale_gradient(self, grad: Any, factor: Any) -> Any:
        """`grad * factor` in `grad`'s dtype; a sparse gradient stays sparse
        (`factor` then multiplies its rows' values)."""

    def shape_and_entries(self, values: Any, weight: Any) -> tuple[tuple[int | None, ...] | None, Any]:
        """The shape of `values * weight` (of `values` for `weight=None`)
        as far as known here (None if its rank is not), and its number of
        entries as a float32 scalar tensor (known at run time)."""

    def no_op(self) -> Any:
        """What a write that does nothing returns (`read_value=False`)."""

    def delegate_tracking(self, optimizer: Any, inner: Any) -> None:
        """Points the checkpoint tracking of a loss-scale `optimizer` that
        hands it to the inner optimizer it was created with (tf_keras's, for
        OptimizerV2) at `inner`; nothing for any other."""


@runtime_checkable
class KeptSlices(Protocol):
    """The hooks of a backend with sparse gradients (TensorFlow's alone):
    a variable's slices kept as slices for a cycle. The core asks for them
    only where `Backend.is_slices` said a gradient is sparse; elsewhere
    `isinstance(backend, KeptSlices)` tells whether slices can be kept."""

    def scatter_into(self, accumulator: Any, grad: Any, weight: Any, first: Any) -> None:
        """Adds the sparse `grad` (times `weight`) into the rows of
        `accumulator`, zeroed first on a cycle's first micro-step (`first`)."""

    def new_kept(self, family: Any, variable: Any, accumulator: Any, n: Any, keep_all: bool,
                 steps: Callable[[], int]) -> Any:
        """A variable's kept slices, empty (`keep_all`: every slice grows;
        `steps`: the cycle's micro-steps so far, read eagerly)."""

    def keep_slices(self, kept: Any, grad: Any, weight: Any, first: Any) -> None:
        """Keeps the sparse `grad` (times `weight`) in `kept`."""

    def kept_slices(self, kept: Any, divisor: Any) -> Any:
        """The cycle's kept slices as one sparse gradient for the optimizer,
        divided by `divisor` (None: undivided); None where they were added
        into rows."""

    def kept_local(self, kept: Any) -> Any:
        """This replica's own kept slices, undivided (no all-reduce)."""

    def kept_counters(self, kept: Any) -> list[Any]:
        """The variables of `kept` that a cycle's first micro-step giving
        its variable no gradient zeroes."""


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


def split_train_step(
    step: Callable[..., Any], args: tuple, kwargs: dict, size: int, splitting: Callable[[Any], Any], model: Any
) -> Any:
    """Keras's train step `step(*args, **kwargs)` of the active backend, run
    once per micro-batch of `size` samples (see `micro_batches`), within
    `splitting(count)`; `model` is the model it trains."""
    given = dict(zip(("state", "data") if active() == "jax" else ("data",), args), **kwargs)
    if active() == "jax":
        from gradaccum._backend.micro_batches import split_jax

        return split_jax(step, given["state"], given["data"], size, splitting)
    if active() == "torch":
        from gradaccum._backend.micro_batches import split_eagerly

        return split_eagerly(step, given["data"], size, splitting)
    from gradaccum._backend.tensorflow.micro_batches import split

    return split(step, given["data"], size, splitting, model)
