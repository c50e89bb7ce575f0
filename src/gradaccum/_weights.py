"""What each micro-step weighs in the mean of its cycle."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from keras import ops

from gradaccum._backend import Backend
from gradaccum._validation import check_weight, check_weight_value

WEIGHT_MESSAGE = "`weight` must be a finite number >= 0 (for example the micro-batch's sample count)."


def _valid(weight: Any) -> Any:
    return ops.logical_and(ops.greater_equal(weight, 0), ops.isfinite(weight))


class Weights:
    """What each micro-step weighs: an explicit `weight`, else one a
    loss-scale wrapping hands over (`weighing`), else the count its loss was
    divided by (`count_next`), else 1 (None).

    Args:
        backend: The backend's hooks.
        weigh_by: `"count"` or `"batch"`.
    """

    def __init__(self, backend: Backend, weigh_by: str):
        self._backend = backend
        self._weigh_by = weigh_by
        # Weights handed over by a loss-scale wrapping for the next micro-step,
        # by replica (each replica applies in a thread of its own).
        self._handed: dict[int, Any] = {}
        # Loss counts handed over for the next micro-step, by replica: each
        # replica computes its loss and applies in a thread of its own.
        self._counts: dict[int, Any] = {}
        # Devices the next micro-step's gradients have an entry for (see
        # `per_device_next`); 0 for gradients of their variables' shape.
        self._devices_next = 0
        # The same for the micro-step running now (`take` sets it).
        self.devices = 0
        # For an explicit weight traced (`take` sets it): whether it is
        # finite and >= 0, a scalar boolean; else None.
        self.accepted: Any = None

    @contextlib.contextmanager
    def weighing(self, weight: Any) -> Iterator[None]:
        """Hands `weight` to the micro-step run within the block.

        A loss-scale optimizer calls the core without a weight; the
        accumulating optimizer around it hands the weight over this way.
        """
        replica = self._backend.replicas.index()
        self._handed[replica] = check_weight(weight)
        try:
            yield
        finally:
            self._handed.pop(replica, None)

    def count_next(self, count: Any) -> None:
        """Hands the next micro-step the count its loss was divided by.

        `model.fit`'s loss computation calls this (see
        `gradaccum._loss_counts`) right before the train step applies the
        gradients of that loss. The next micro-step of this replica without
        an explicit `weight` weighs `count`; with `weigh_by="batch"`, or
        `count=None`, it weighs 1. A count is used once, only in the trace
        (or eager run) it was computed in; a newer count replaces one not
        used yet.

        Args:
            count: A scalar float32 tensor, or None.
        """
        replica = self._backend.replicas.index()
        if count is None or self._weigh_by != "count":
            self._counts.pop(replica, None)
        else:
            self._counts[replica] = count

    def per_device_next(self, weights: Any) -> None:
        """Hands the next micro-step one weight per device, for gradients
        that are each device's own: a leading axis of one entry per device
        (`gradaccum._data_parallel`). Used once, as `count_next`'s count.

        Args:
            weights: A float32 vector, one entry per device.
        """
        self._counts[self._backend.replicas.index()] = weights
        self._devices_next = int(weights.shape[0])

    def _check_value(self, weight: Any) -> None:
        backend = self._backend
        if not backend.reads_back:
            # Checked on the device, without reading it (PyTorch).
            backend.tensors.assert_that(lambda: _valid(weight), WEIGHT_MESSAGE)
        elif backend.known(weight):
            check_weight_value(float(ops.convert_to_numpy(weight)))
        else:
            # Traced: the step checks it at run time (`accepted`).
            self.accepted = _valid(weight)

    def checks(self) -> list[tuple[Callable[[], Any], str]]:
        """The run-time checks of this micro-step's weight, `(condition,
        message)`: one where it is traced (see `accepted`), else none."""
        accepted = self.accepted
        return [] if accepted is None else [(lambda: accepted, WEIGHT_MESSAGE)]

    def refused_unless(
        self, state: Any, first: Any, steps: Any, ends: Any, weight: Any, grads: Sequence[Any], indices: Sequence[int],
        asserted: bool,
    ) -> tuple[Any, Any, Any, Any, list[Any]]:
        """A micro-step's `(first, steps, ends, weight, grads)`, made to
        write nothing new unless its traced weight is `accepted` (as given
        where there is nothing to check).

        Where no run-time assertion stops a refused weight's micro-step (XLA,
        `jax.jit`), it runs as one that is not its cycle's first nor its
        last, does not advance the count, and adds nothing: zero-weighted
        zeros, or -inf into a maximum, instead of gradients a NaN weight
        would turn into NaNs. Every write then keeps the value it reads
        (`Position.mark` takes `accepted` too).

        Args:
            state: The accumulation state (which accumulators keep a maximum).
            first, steps, ends, weight: As the micro-step has them.
            grads: The micro-step's gradients (None where a variable has none).
            indices: Each gradient's position in the state.
            asserted: Whether a run-time assertion of `accepted` stops the
                micro-step before it writes (`checked`): then nothing is
                refused here, and the gradients are not selected again.
        """
        accepted, backend = self.accepted, self._backend
        if accepted is None or asserted:
            return first, steps, ends, weight, list(grads)

        def refused(grad: Any, index: int) -> Any:
            if grad is None:
                return None
            slices = backend.gradients.is_slices(grad)
            values = grad.values if slices else grad
            fill = float("-inf") if state.keeps_maximum(index) else 0.0
            values = ops.where(accepted, values, ops.full_like(values, fill))
            return type(grad)(values, grad.indices, grad.dense_shape) if slices else values

        return (
            ops.logical_and(first, accepted),
            ops.where(accepted, steps, steps - 1),
            ops.logical_and(ends, accepted),
            ops.where(accepted, weight, ops.zeros_like(weight)),
            [refused(g, i) for g, i in zip(grads, indices)],
        )

    def if_accepted(self, fn: Callable[..., None], *args: Any) -> None:
        """Runs `fn(*args)`, only where a traced weight is `accepted`: for
        writes that a refused weight's zeros would still change (kept
        slices, appended or replacing the indices held)."""
        if self.accepted is None:
            fn(*args)
        else:
            self._backend.when(self.accepted, lambda: fn(*args))

    def take(self, weight: Any) -> tuple[Any, Any]:
        """`(weight, count)` for this micro-step: the explicit weight
        or the handed one (checked: a number always, a tensor where its
        value is known, else at run time: see `accepted`), and the loss
        count. The count is taken either way, so that it never outlives its
        step.

        Raises:
            TypeError, ValueError: For a wrong explicit weight.
        """
        self.accepted = None
        weight = check_weight(weight)
        if weight is None:
            weight = self._handed.pop(self._backend.replicas.index(), None)
        if weight is not None and not isinstance(weight, float):
            self._check_value(weight)
        count = self._counts.pop(self._backend.replicas.index(), None)
        self.devices, self._devices_next = self._devices_next, 0
        if count is not None and not self._backend.gradients.usable_here(count):
            count, self.devices = None, 0
        return weight, count


@contextlib.contextmanager
def checked(backend: Backend, checks: Sequence[tuple[Callable[[], Any], str]]) -> Iterator[bool]:
    """Runs the block's ops after the run-time `checks` (condition,
    message), where the backend asserts at run time (a `tf.function`
    without XLA), so that a failed one leaves the state as it was. Yields
    whether every check is asserted so (nothing then runs unless it holds)."""
    with contextlib.ExitStack() as stack:
        asserted = [stack.enter_context(backend.tensors.guarded(c, m)) for c, m in checks]
        yield bool(asserted) and all(asserted)

