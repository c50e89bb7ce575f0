"""The cycle's position: the micro-steps the current cycle has taken, and
which variables took part in it.

One interface, `Position`, two kinds, chosen by the backend
(`Backend.position`):

- `DevicePosition` (TensorFlow, JAX): the micro-step counter and the flags
  of the variables that took part are variables, read where the step runs
  (traced steps included).
- `HostPosition` (PyTorch): Python integers and a set, written to the
  counter without reading it, so that a micro-step reads nothing back from
  the device (reading a value waits for every queued operation).

Both take the cycle's length from `length`, an object with
`current(applied, checks)` (`n` as a backend integer tensor) and
`on_host(applied)` (`n` as a Python int): `gradaccum._cycle.Cycle`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from keras import ops


class Position(Protocol):
    """Where the current cycle stands; the core asks nothing else about it."""

    def steps(self) -> Any:
        """Micro-steps the current cycle has taken (a Python int where kept
        on the host, else a backend integer tensor)."""

    def next(
        self, length: Any, applied: Any, checks: list[tuple[Callable[[], Any], str]], index: Any = None
    ) -> tuple[Any, Any, Any]:
        """`(first, steps, ends)` of the micro-step now running: whether it
        is its cycle's first, the cycle's micro-steps with it, whether it is
        the apply step (ends the cycle). `applied`: the wrapped optimizer's
        `iterations`, which a schedule of `n` takes; a traced `n`'s run-time
        checks are appended to `checks`. `index`: the micro-step's index in
        its cycle where a deferring split step's loop counts it
        (`Cycle.index`), else None."""

    def pending(self) -> tuple[Any, Any] | None:
        """`(steps, ends)` for `flush`: the micro-steps the cycle holds and
        whether it holds any; None where it is known to hold none."""

    def advance(self, ends: Any, steps: Any) -> None:
        """Moves to the next micro-step: back to 0 if `ends`, else `steps`."""

    def n(self, length: Any, applied: Any) -> int | None:
        """`n` for the current cycle as a Python int, where it is known
        without tracing; else None."""

    def handed_over(self) -> None:
        """Counts an update handed straight over (`n=1`)."""

    def resync(self, counter: bool, applied: Any) -> None:
        """Takes the position from the variables (if `counter`) and the
        applied-update count from `applied` (None: not needed), after a
        build or a restore."""

    def mark(self, took_part: set[int], first: Any, accepted: Any = None) -> None:
        """Records the positions of the variables that took part in this
        micro-step (with those of the cycle's earlier ones; only these on
        its first); nothing where a traced `accepted` is false."""

    def took_part(self) -> set[int] | None:
        """The positions that took part in the current cycle, where that is
        known on the host; else None (see `took_part_in_cycle`)."""

    def took_part_in_cycle(self, index: int) -> Callable[[], Any]:
        """A function returning whether variable `index` took part in the
        current cycle (a scalar boolean tensor; read where it is called)."""

    def load_took_part(self, took_part: set[int], count: int) -> None:
        """Writes which of `count` variables took part in the current cycle
        (a restore)."""

    def saved(self) -> Any:
        """What the host holds, for `restore` (a step that raises)."""

    def restore(self, saved: Any) -> None:
        """Puts back what `saved` returned."""


class DevicePosition:
    """The position in variables (see the module docstring).

    Args:
        backend: The backend's hooks.
        counter: The micro-step counter variable.
        flags: An integer vector variable, 1 for each variable that took
            part in the current cycle; or None where the backend keeps none.
    """

    def __init__(self, backend: Any, counter: Any, flags: Any):
        self._backend = backend
        self._counter = counter
        self._flags = flags

    def steps(self) -> Any:
        return self._backend.read(self._counter)

    def next(
        self, length: Any, applied: Any, checks: list[tuple[Callable[[], Any], str]], index: Any = None
    ) -> tuple[Any, Any, Any]:
        micro_step = self._backend.read(self._counter) if index is None else index
        steps = micro_step + 1
        return ops.equal(micro_step, 0), steps, ops.greater_equal(steps, length.current(applied, checks))

    def pending(self) -> tuple[Any, Any] | None:
        steps = self._backend.read(self._counter)
        if self._backend.known(steps) and int(ops.convert_to_numpy(steps)) == 0:
            return None
        return steps, ops.greater(steps, 0)

    def advance(self, ends: Any, steps: Any) -> None:
        self._backend.assign(self._counter, ops.where(ends, ops.zeros_like(steps), steps))

    def n(self, length: Any, applied: Any) -> int | None:
        n = length.current(applied)
        return int(ops.convert_to_numpy(n)) if self._backend.known(n) else None

    def handed_over(self) -> None:
        return None

    def resync(self, counter: bool, applied: Any) -> None:
        return None

    def mark(self, took_part: set[int], first: Any, accepted: Any = None) -> None:
        if self._flags is None:
            return
        count = int(self._flags.shape[0])
        mask = ops.convert_to_tensor([int(i in took_part) for i in range(count)], dtype="int32")
        mask = mask if accepted is None else ops.where(accepted, mask, ops.zeros_like(mask))
        before = self._backend.read(self._flags)
        self._backend.assign(self._flags, ops.where(first, mask, ops.maximum(before, mask)))

    def took_part(self) -> set[int] | None:
        return None

    def took_part_in_cycle(self, index: int) -> Callable[[], Any]:
        return lambda: ops.greater(self._backend.read(self._flags)[index], 0)

    def load_took_part(self, took_part: set[int], count: int) -> None:
        if self._flags is not None:
            self._backend.load(self._flags, np.array([int(i in took_part) for i in range(count)], np.int32), True)

    def saved(self) -> Any:
        return None  # the variables are put back with the state's

    def restore(self, saved: Any) -> None:
        return None


class HostPosition:
    """The position on the host (see the module docstring).

    Args:
        backend: The backend's hooks.
        counter: The micro-step counter variable, written, never read, per
            micro-step (checkpoints and files read it).
    """

    def __init__(self, backend: Any, counter: Any):
        self._backend = backend
        self._counter = counter
        self._steps = 0
        # The wrapped optimizer's applied updates, once a schedule needs them.
        self._applied: int | None = None
        self._took_part: set[int] = set()

    def steps(self) -> int:
        return self._steps

    def next(
        self, length: Any, applied: Any, checks: list[tuple[Callable[[], Any], str]], index: Any = None
    ) -> tuple[Any, Any, Any]:
        steps = (self._steps if index is None else int(index)) + 1
        return steps == 1, steps, steps >= length.on_host(self._applied)

    def pending(self) -> tuple[Any, Any] | None:
        return None if self._steps == 0 else (self._steps, True)

    def advance(self, ends: Any, steps: Any) -> None:
        self._steps = 0 if ends else steps
        if ends and self._applied is not None:
            self._applied += 1
        self._backend.assign(self._counter, self._steps)

    def n(self, length: Any, applied: Any) -> int | None:
        return length.on_host(self._applied)

    def handed_over(self) -> None:
        if self._applied is not None:
            self._applied += 1

    def resync(self, counter: bool, applied: Any) -> None:
        if counter:
            self._steps = int(self._backend.saved(self._counter, False))
        if applied is not None:
            self._applied = int(ops.convert_to_numpy(applied))

    def mark(self, took_part: set[int], first: Any, accepted: Any = None) -> None:
        self._took_part = set(took_part) if first else self._took_part | took_part

    def took_part(self) -> set[int] | None:
        return self._took_part

    def took_part_in_cycle(self, index: int) -> Callable[[], Any]:
        return lambda: index in self._took_part

    def load_took_part(self, took_part: set[int], count: int) -> None:
        self._took_part = set(took_part)

    def saved(self) -> Any:
        return set(self._took_part), self._steps, self._applied

    def restore(self, saved: Any) -> None:
        took_part, self._steps, self._applied = saved
        self._took_part = set(took_part)

