"""The accumulating core's interface, and what its backends share.

`gradaccum._accumulation.Accumulation` (TensorFlow) and
`gradaccum._portable.accumulation.Accumulation` (JAX, PyTorch) run a
micro-step each their own way; `gradaccum._engines` picks one. What does not
depend on the backend lives here: the settings, `n`, the callbacks waiting
for the state, the weight a loss-scale front hands over, and the objects
whose partial cycle `flush()` ends too. The methods a backend implements are
listed at the end.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

from gradaccum._agc import AdaptiveClipping
from gradaccum._cycle import CycleLength
from gradaccum._family import OptimizerFamily
from gradaccum._validation import check_weight
from gradaccum._view import AccumulationState


class AccumulationBase:
    """Gradient accumulation for one optimizer: the backend-neutral part.

    Args:
        family: The wrapped optimizer's family.
        cycle: The cycle's length (`n`, checked), in the backend's form.
        reduction: `"mean"` or `"sum"` (checked).
        mode: `"masked"` or `"skip"` (checked).
        weigh_by: `"count"` or `"batch"` (checked): whether a micro-batch
            without an explicit weight weighs the count handed over by
            `count_next` (see `gradaccum._loss_counts`) or 1.
        on_built: Called once the state exists (with the state's checkpoint
            module on TensorFlow, None elsewhere).
        sparse: `"rows"` or `"slices"` (checked).
        agc: Adaptive gradient clipping of every update's gradient
            (`gradaccum._agc`), or None.
    """

    def __init__(
        self,
        family: OptimizerFamily,
        cycle: CycleLength,
        reduction: str,
        mode: str,
        weigh_by: str,
        on_built: Callable[[Any], None],
        sparse: str,
        agc: AdaptiveClipping | None,
    ):
        self.family = family
        self.agc = agc
        self.cycle = cycle
        self.reduction = reduction
        self.mode = mode
        self.weigh_by = weigh_by
        self.sparse = sparse
        self.state: Any = None
        self._on_built = on_built
        # A weight handed over by a loss-scale front for the next micro-step.
        self._handed_weight: Any = None
        # What waits for the state to exist (`when_built`).
        self._after_build: list[Callable[[], None]] = []
        # Objects whose own partial cycle `flush()` ends too (`follow`), by id.
        self._followers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    # ------------------------------------------------------------------
    # Settings and state.

    def set_n(self, value: Any) -> None:
        self.cycle.set(value)
        if self.state is not None:
            self.state.n_code = self.cycle.code

    def current_n(self) -> Any:
        """`n` for the current cycle, as a backend integer tensor."""
        return self.cycle.current(self.family.iterations)

    @property
    def built(self) -> bool:
        return self.family.built and self.state is not None

    def when_built(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once the optimizer and the state are built.

        At once if they are; otherwise right after the state is built (by
        `build` or the first micro-step, eagerly even while a step is
        traced), in the order the callbacks were given. The proxy hands over
        this way what a Keras file loaded into an unbuilt optimizer.
        """
        if self.built:
            callback()
        else:
            self._after_build.append(callback)

    def _take_waiting(self) -> list[Callable[[], None]]:
        """The callbacks `when_built` kept, handed over once."""
        waiting, self._after_build = self._after_build, []
        return waiting

    # ------------------------------------------------------------------
    # What a micro-step is handed.

    @contextlib.contextmanager
    def weighing(self, weight: Any) -> Iterator[None]:
        """Hands `weight` to the micro-step run within the block.

        A loss-scale front calls the loss-scale optimizer, which calls the
        core without a weight; the front hands it over this way.
        """
        self._handed_weight = check_weight(weight)
        try:
            yield
        finally:
            self._handed_weight = None

    def follow(self, follower: Any) -> None:
        """Makes `flush()` call `follower.flush()` too, while it lives.

        A layer that keeps statistics per cycle (`gradaccum.layers`) ends
        its partial cycle when the optimizer's ends.
        """
        self._followers[id(follower)] = follower

    def _flush_followers(self) -> None:
        for follower in list(self._followers.values()):
            follower.flush()

    # ------------------------------------------------------------------
    # What each backend implements.

    def micro_step(self) -> Any:
        """Micro-steps taken in the current cycle (a backend tensor)."""
        raise NotImplementedError

    def will_apply(self) -> Any:
        """Whether the next micro-step ends the cycle (a backend tensor)."""
        raise NotImplementedError

    def view(self) -> AccumulationState | None:
        """The state as `AccumulatingOptimizer.accumulation_state` shows it."""
        raise NotImplementedError

    def own_variables(self) -> list[Any]:
        """The state's variables the proxy lists in `variables`."""
        raise NotImplementedError

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer (if needed) and the state."""
        raise NotImplementedError

    def count_next(self, count: Any) -> None:
        """Hands the next micro-step the count its loss was divided by."""
        raise NotImplementedError

    def step(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any] | None,
        weight: Any,
        options: Mapping[str, Any],
    ) -> None:
        """Accumulates one micro-batch; applies if it completes the cycle."""
        raise NotImplementedError

    def flush(self) -> None:
        """Applies what the current cycle holds now, if anything."""
        raise NotImplementedError
