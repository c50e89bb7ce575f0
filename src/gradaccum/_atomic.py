"""Steps that are all or nothing: a step that raises leaves the state as it was.

A plain optimizer whose update raises leaves its variables as they were, and
so must a micro-step, its apply step and `flush`, so that running the same
micro-batch again equals never having failed:

- Traced (a TensorFlow graph, XLA), every write of a micro-step waits for
  all of its inputs (`Backend.after`): a failing assertion in the loss, or a
  gradient whose shape the trace left unknown and that is not its
  variable's, stops the step before anything is written.
- Eagerly, on the step that ends a cycle the accumulators and counters are
  written before the wrapped optimizer's update runs; if the update raises,
  `unchanged_if_raised` puts them back. An in-between step runs no update
  (`Core._finish_if`), so nothing can fail after its gradients were added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from gradaccum._backend import Backend
from gradaccum._state import State


def unchanged_if_raised(state: State, backend: Backend, ends: Any) -> contextlib.AbstractContextManager[None]:
    """A block that an exception leaves with `state` as it was when the
    block began, where the step it runs ends its cycle eagerly (`ends`
    known and true); elsewhere a block that does nothing.

    Args:
        state: The accumulation state.
        backend: The backend's hooks.
        ends: Whether the step ends its cycle (a Python or backend boolean).

    Returns:
        A context manager.
    """
    if backend.known(ends) and bool(ends):
        return _restored_on_failure(state, backend)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restored_on_failure(state: State, backend: Backend) -> Iterator[None]:
    # A snapshot: free on JAX (its arrays are never written in place), a copy
    # of the accumulators on PyTorch and TensorFlow (there made by the first
    # write after it), once per cycle, on its last micro-step only.
    restore = saved(state, backend)
    try:
        yield
    except BaseException:
        restore()
        raise


def saved(state: State, backend: Backend, accumulators: bool = True) -> Callable[[], None]:
    """The accumulation state's values now, and how to put them back.

    Args:
        state: The accumulation state.
        backend: The backend's hooks.
        accumulators: Whether the accumulators (and their compensations)
            are saved too; a cycle's first micro-step writes over them, so
            a caller that puts the state back to a cycle's start can leave
            them out.

    Returns:
        A function that writes the saved values back.
    """
    variables = [*state.accumulators, *(state.compensations or [])] if accumulators else []
    variables += [state.micro_step, state.weight_total]
    variables += [v for v in (state.n, state.took_part) if v is not None]
    variables += state.noise.variables() if state.noise is not None else []
    values = [backend.snapshot(v) for v in variables]
    kept = [backend.kept_saved(k) for k in state.kept.values() if not getattr(k, "rows_only", False)]
    host = (set(state.took_part_ever), state.position.saved())

    def restore() -> None:
        for variable, value in zip(variables, values):
            backend.assign(variable, value)
        for restore_kept in kept:
            restore_kept()
        state.took_part_ever = host[0]
        state.position.restore(host[1])

    return restore
