"""The cycle's length: `n`, a schedule of it, and the `n=1` hand-over."""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from keras import ops

from gradaccum._adaptive import NoiseScaleSchedule
from gradaccum._validation import check_n

TRACED_BELOW_ONE = (
    "gradaccum: the `n` schedule is traced, so its value is checked at run time: a value below 1 "
    "raises where the backend has run-time assertions (a `tf.function` without XLA) and is taken "
    "as 1 where it has none (XLA, `jax.jit`). Return an int >= 1."
)


class Cycle:
    """Micro-batches per applied update: an int that may be set between
    cycles, or a schedule of the applied-update count.

    Once the state is built, an int lives in a variable (`attach`), so that
    setting it needs no new trace. With `n=1` the gradients go straight to
    the wrapped optimizer (`hands_over`); a function traced then keeps doing
    so, which `hand_over_guard` makes a traced step refuse where the backend
    has run-time assertions (TensorFlow), and which setting another `n`
    warns about everywhere.

    Args:
        n: An int >= 1 or a callable (checked).
        backend: The backend's hooks.
    """

    def __init__(self, n: int | Callable[[Any], Any], backend: Any):
        self.schedule = None if isinstance(n, int) else n
        self._n = n if isinstance(n, int) else None
        self._backend = backend
        self._variable: Any = None
        # Whether a traced function hands gradients straight over (n=1).
        self._handed_over_in_trace = False
        # With `from_noise_scale`: the variable holding the chosen `n`
        # (`follow`), and on the host its value for one applied-update count.
        self._chosen: Any = None
        self._host_chosen: tuple[int | None, int] | None = None
        # Whether a traced schedule's rule was warned about.
        self._warned_traced = False
        # While a train step is split into micro-batches (`splitting`): its
        # number of micro-batches, the cycle's length for that step; where
        # the cycle's update is deferred, the micro-batch's index in the
        # step's loop and the positions that took part so far. Each
        # replica's own: a `tf.distribute` strategy traces each replica's
        # step in threads of its own.
        self._split_steps: dict[int, dict[str, Any]] = {}

    def _split_step(self) -> dict[str, Any]:
        return self._split_steps.get(self._backend.replicas.index(), {})

    split = property(lambda self: self._split_step().get("split"))
    index = property(lambda self: self._split_step().get("index"))
    took_part = property(lambda self: self._split_step().get("took_part"))

    @contextlib.contextmanager
    def splitting(self, count: Any, defer: bool = False) -> Iterator[None]:
        """Makes the micro-steps run within the block one cycle of `count`
        micro-batches: a Python int, or an integer tensor where the batch's
        size is known only when the step runs (a TensorFlow graph).

        With `defer`, the micro-steps only accumulate: each runs at the
        `index` its loop sets, and the cycle's update runs once the loop is
        done (see `gradaccum._micro_batches`)."""
        replica = self._backend.replicas.index()
        self._split_steps[replica] = {"split": count, "took_part": set() if defer else None}
        try:
            yield
        finally:
            del self._split_steps[replica]

    def at(self, index: Any) -> None:
        """Sets the micro-batch's index in a deferring split step's loop."""
        self._split_step()["index"] = None if index is None else ops.cast(index, self._backend.counter_dtype)

    def deferred(self, took_part: set[int]) -> bool:
        """Whether the micro-step running leaves its cycle's update to the
        end of its split step's loop; if so, records the positions that
        `took_part` in it, which that update takes."""
        if self.took_part is None:
            return False
        self.took_part.update(took_part)
        return True

    @property
    def value(self) -> int | Callable[[Any], Any]:
        """The int, or the schedule given."""
        return self.schedule if self.schedule is not None else self._n

    @property
    def code(self) -> int:
        """What saved state records: the int, 0 for a schedule."""
        return 0 if self.schedule is not None else self._n

    def attach(self, variable: Any) -> None:
        """Reads an int `n` from `variable` from now on (None for a schedule)."""
        self._variable = variable

    def follow(self, chosen: Any) -> None:
        """Takes `n` from the variable `chosen` (a float32 scalar the noise
        scale sets at the end of each cycle; 0 before one is measured),
        for a `from_noise_scale` schedule."""
        self._chosen = chosen
        self._host_chosen = None

    def reread(self) -> None:
        """Reads the chosen `n` anew on the host (after a restore)."""
        self._host_chosen = None

    def _adaptive(self) -> NoiseScaleSchedule | None:
        return self.schedule if isinstance(self.schedule, NoiseScaleSchedule) else None

    def set(self, value: Any) -> None:
        """Sets an int `n` (see `AccumulatingOptimizer.n`).

        Raises:
            TypeError/ValueError: For anything but an int >= 1, or if `n` was
                given as a schedule.
        """
        if self.schedule is not None:
            raise ValueError(
                "`n` was given as a schedule (a callable); it cannot be set to "
                "an int afterwards. Let the schedule return the new value."
            )
        value = check_n(value, self._backend.counter_dtype)
        if value != 1 and self._n == 1 and self._handed_over_in_trace:
            warnings.warn(
                f"`n` set to {value}, but a function (`tf.function`, `jax.jit`) traced with n=1 hands "
                "gradients straight to the wrapped optimizer and keeps doing "
                "so: trace it anew (for `model.fit`: "
                "`model.make_train_function(force=True)`, or compile again).",
                RuntimeWarning,
                stacklevel=4,
            )
        self._n = value
        if self._variable is not None:
            self._backend.assign(self._variable, value)

    def current(self, applied: Any, checks: list[tuple[Callable[[], Any], str]] | None = None) -> Any:
        """`n` for the current cycle, as an integer tensor of the backend's
        counter dtype.

        A schedule's value is checked where it is known (a Python int, or
        eagerly). Traced, a value below 1 is taken as 1 (warned once, when
        traced); the step's run-time check that it is not (`checks`) raises
        where the backend has run-time assertions (a `tf.function` without
        XLA).

        Args:
            applied: The wrapped optimizer's `iterations` (applied updates),
                which a schedule takes.
            checks: Where given, the run-time checks of a traced value are
                appended to it: `(condition, message)`.

        Raises:
            ValueError: If a schedule returns a value below 1, or above what
                the counters hold, where that is known.
        """
        dtype = self._backend.counter_dtype
        if self.split is not None:
            return ops.cast(self.split, dtype)
        adaptive = self._adaptive()
        if adaptive is not None:
            if self._chosen is None:
                return ops.convert_to_tensor(adaptive.min_n, dtype=dtype)
            # Under several replicas, each holds 1/replicas of the choice
            # (`gradaccum._noise`); one replica, or a read across them, all of it.
            chosen = self._backend.read(self._chosen) * float(self._backend.replicas.count())
            n = ops.cast(ops.round(chosen), dtype)
            return ops.maximum(n, ops.cast(adaptive.min_n, dtype))
        if self.schedule is not None:
            n = self.schedule(applied)
            if isinstance(n, numbers.Integral) or self._backend.known(n):
                return ops.convert_to_tensor(self._checked(n), dtype=dtype)
            n = ops.cast(n, dtype)
            self._warn_traced()
            if checks is not None:
                checks.append((lambda: ops.greater_equal(n, 1), TRACED_BELOW_ONE))
            return ops.maximum(n, ops.cast(1, dtype))
        if self._variable is None:
            return ops.convert_to_tensor(self._n, dtype=dtype)
        return self._backend.read(self._variable)

    def on_host(self, applied: int | None) -> int:
        """`n` for the current cycle as a Python int, for a backend that keeps
        the cycle's position on the host: the int, or the schedule called
        with the applied-update count as a Python int. A schedule that
        returns a tensor is read back from the device; one that returns a
        Python int reads nothing; `from_noise_scale`'s choice is read from
        the device once per cycle.

        Raises:
            ValueError: If the schedule returns a value below 1.
        """
        if self.split is not None:
            return int(self.split)
        if self.schedule is None:
            return self._n
        adaptive = self._adaptive()
        if adaptive is not None:
            # Read from the device once per cycle (the choice is made when
            # a cycle ends, and `applied` counts the cycles ended).
            if self._host_chosen is None or self._host_chosen[0] != applied:
                chosen = 0 if self._chosen is None else int(ops.convert_to_numpy(self._chosen))
                self._host_chosen = (applied, max(chosen, adaptive.min_n))
            return self._host_chosen[1]
        return self._checked(self.schedule(applied))

    def _checked(self, n: Any) -> int:
        """A schedule's known value as an int, or raises naming `n`."""
        n = n if isinstance(n, numbers.Integral) else int(ops.convert_to_numpy(n))
        if n < 1:
            raise ValueError(f"The `n` schedule returned {n}; it must return an int >= 1.")
        try:
            return check_n(n, self._backend.counter_dtype)
        except ValueError as error:
            raise ValueError(f"The `n` schedule returned {n}: {error}") from None

    def _warn_traced(self) -> None:
        """Warns once that a traced schedule's values below 1 are taken as 1
        where the backend cannot raise at run time."""
        if not self._warned_traced:
            self._warned_traced = True
            warnings.warn(TRACED_BELOW_ONE, RuntimeWarning, stacklevel=2)

    def hands_over(self) -> bool:
        """Whether every micro-batch is a whole batch (`n` is the int 1, and
        no train step is split into more than one micro-batch)."""
        return self._n == 1 and (self.split is None or (isinstance(self.split, int) and self.split == 1))

    def hand_over_guard(self, traced: bool) -> Any:
        """The context a step that hands gradients over runs in.

        A trace keeps the hand-over whatever `n` is set to later: traced, the
        guard stops the step from running once `n` is no longer 1.
        """
        if traced:
            self._handed_over_in_trace = True
        variable, backend = self._variable, self._backend
        return backend.tensors.guarded(
            lambda: ops.equal(backend.read(variable), 1),
            "gradaccum: this function was traced with n=1, which hands "
            "gradients straight to the wrapped optimizer, but `n` has changed "
            "since; trace it anew.",
        )
