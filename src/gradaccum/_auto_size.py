"""`micro_batch_size="auto"`: the search for the largest micro-batch whose train step fits.

One `Search` per accumulating core holds the size the train step is traced
with. It is chosen on the first batch of `fit` (`start`):

- JAX: predicted before running, from XLA's compiled memory analysis of the
  train step (`_backend.micro_batches.step_bytes`): the whole batch is
  measured; if it does not fit the limit, the step split into a quarter
  and a half of the batch, and a line through the two gives the largest
  size under the limit. At most 3 compilations; a size below a quarter is
  extrapolated, and the out-of-memory retry is the fallback.
- TensorFlow and PyTorch: probed: the whole batch first.

Where the size that fits is at least twice `SMALLEST_TRIAL`, the first steps
time it and smaller sizes (`timed`), and the fastest stays: the largest size
that fits is not always the fastest.

Sizes are balanced (`balanced`): the fewest micro-batches `k` that fit and
divide the batch (any int, not only powers of two), else `ceil(B / k)` with
a ragged last one. Where a step runs out of memory anyway, the same batch
runs again with more micro-batches (`smaller`), never fewer later. The size is logged once (logger
`"gradaccum"`, at INFO) and read by `opt.micro_batch_size`; configs keep it.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

_LOG = logging.getLogger("gradaccum")
# The throughput trial: each size is timed over this many steps (after the
# one that compiles it); sizes below the smallest are not tried.
TRIAL_STEPS = 2
SMALLEST_TRIAL = 64
MOST_TRIALS = 3
_SEARCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def balanced(batch: int, size: int) -> int:
    """The micro-batch for `batch` samples in micro-batches of at most `size`:
    the fewest micro-batches `k` that divide the batch, up to twice as many
    as `size` needs (a ragged last micro-batch is a second traced body, with
    memory of its own); else `ceil(batch / k)` for the fewest `k`."""
    fewest = math.ceil(batch / max(1, min(size, batch)))
    for count in range(fewest, 2 * fewest + 1):
        if batch % count == 0:
            return batch // count
    return math.ceil(batch / fewest)


class Search:
    """The micro-batch size of one accumulating optimizer with `"auto"`.

    Args:
        limit: The `memory_limit` given, or None.
        chosen: A size chosen earlier (a config's), or None.
    """

    def __init__(self, limit: int | None, chosen: int | None = None):
        self.limit = limit
        self.size = chosen
        self.compilations = 0
        # The throughput trial's batch and seconds per step by size; None
        # once settled (or for a size a config gave).
        self.batch: int | None = None
        self.predicted: int | None = None  # the first size, before any trial or retry
        self.seconds: dict[int, list[float]] | None = None if chosen is not None else {}

    def start(self, batch: int, measure: Callable[[int], int] | None) -> int:
        """Chooses the size for batches of `batch` samples, where none is.

        Args:
            batch: The first batch's samples.
            measure: The bytes of the step at a given size (one compilation
                each), or None where the backend cannot tell (probing).

        Returns:
            The size.

        Raises:
            MemoryError: If the step does not fit even at micro-batches of 1.
        """
        if self.size is None:
            if measure is None and self.limit is not None:
                warnings.warn(
                    f"micro_batch_size=\"auto\": memory_limit={self.limit} predicts the size on JAX only; "
                    "here the size is probed, from the whole batch down where the device runs out of memory.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            size = batch if measure is None else self._predicted(batch, measure)
            self._choose(_device().agreed(size), "predicted" if measure is not None else "probed from the batch")
            self.batch, self.predicted = batch, self.size
            if _trial(batch, self.size) is None or _device().several_processes():
                # Processes would time differently and disagree on the size.
                self.seconds = None
        return self.size

    @property
    def timing(self) -> bool:
        """Whether steps are timed (the throughput trial is on)."""
        return self.seconds is not None

    def timed(self, batch: int, seconds: float) -> None:
        """Takes the time of a step at `size` (not its first, which compiles).

        The largest size that fits is not always the fastest (on a CPU,
        smaller matrices can stay in cache): after `TRIAL_STEPS` steps of a
        size, the next smaller one is tried while the last was faster than
        the one before, at most `MOST_TRIALS` sizes; then the fastest stays.
        Every size is exact, so the trial's steps are training steps.
        """
        if self.seconds is None or batch != self.batch:
            return
        times = self.seconds.setdefault(self.size, [])
        times.append(seconds)
        if len(times) < TRIAL_STEPS:
            return
        best = min(self.seconds, key=lambda s: min(self.seconds[s]))
        smaller = _trial(batch, self.size)
        if best == self.size and smaller is not None and len(self.seconds) < MOST_TRIALS:
            self.size = smaller
            return
        self.seconds = None
        self._choose(best, "the fastest of the sizes that fit, timed")

    def smaller(self, batch: int, error: BaseException) -> int:
        """The size after a step with `size` ran out of memory: one
        micro-batch more for the same batch.

        Raises:
            MemoryError: If the size is 1 already, saying what the device
                has; chained to `error`.
        """
        size = min(self.size or batch, batch)
        if size <= 1:
            raise MemoryError(
                "micro_batch_size=\"auto\": the train step does not fit even at micro-batches of 1 sample; "
                f"{self._has()} The device said: {error}"
            ) from error
        self.seconds = None  # no throughput trial after running out of memory
        count = math.ceil(batch / size) + 1
        while balanced(batch, math.ceil(batch / count)) >= size:
            count += 1
        self._choose(balanced(batch, math.ceil(batch / count)), f"after running out of memory at {size}")
        return self.size

    def _predicted(self, batch: int, measure: Callable[[int], int]) -> int:
        limit = self.limit if self.limit is not None else _device().free_bytes()
        if limit is None:
            return batch
        # The whole batch first: unsplit, it holds no accumulators.
        top = self._measure(measure, batch)
        if top <= limit:
            return batch
        if batch == 1:
            self._refuse(top, limit)
        # Split, the bytes grow by a constant per sample: a line through
        # two sizes gives the largest that fits.
        low_size, high_size = max(1, batch // 4), max(1, batch // 2)
        low = self._measure(measure, low_size)
        high = self._measure(measure, high_size) if high_size != low_size else low
        if high <= limit:
            return balanced(batch, high_size)
        slope = (high - low) / (high_size - low_size) if high_size > low_size else 0.0
        if slope <= 0:
            return balanced(batch, low_size) if low <= limit else self._refuse(low, limit)
        size = int(low_size + (limit - low) // slope)
        if size < 1:
            self._refuse(low - slope * (low_size - 1), limit)
        return balanced(batch, size)

    def _measure(self, measure: Callable[[int], int], size: int) -> int:
        self.compilations += 1
        return measure(size)

    def _refuse(self, need: float, limit: int) -> Any:
        raise MemoryError(
            "micro_batch_size=\"auto\": the train step does not fit even at micro-batches of 1 sample: "
            f"it needs {int(need)} bytes (XLA's memory analysis) and has {limit} bytes "
            f"({'memory_limit' if self.limit is not None else 'free on the device'})."
        )

    def _has(self) -> str:
        if self.limit is not None:
            return f"memory_limit={self.limit} bytes."
        free = _device().free_bytes()
        return "" if free is None else f"the device has {free} bytes free."

    def _choose(self, size: int, how: str) -> None:
        if size != self.size or how.startswith("the fastest"):
            _LOG.info("gradaccum: micro_batch_size=\"auto\" chose %d (%s).", size, how)
        self.size = size


def _trial(batch: int, size: int) -> int | None:
    """The next smaller size the throughput trial times, or None."""
    smaller = balanced(batch, size // 2) if size >= 2 else size
    return smaller if SMALLEST_TRIAL <= smaller < size else None


def search_of(core: Any) -> Search:
    """The search of `core` (whose `micro_batch_size` is `"auto"`)."""
    search = _SEARCHES.get(core)
    if search is None:
        search = _SEARCHES[core] = Search(core.settings.memory_limit)
    return search


def size_of(core: Any) -> int | str | None:
    """What `opt.micro_batch_size` reads: the setting, or with `"auto"` the
    size chosen (`"auto"` until a step chose one)."""
    size = core.settings.micro_batch_size
    if size != "auto":
        return size
    search = _SEARCHES.get(core)
    return "auto" if search is None or search.size is None else search.size


def restore(core: Any, chosen: Any) -> None:
    """Gives `core` the size a config recorded (None: nothing to restore)."""
    if chosen is not None and core.settings.micro_batch_size == "auto":
        search = search_of(core)
        search.size, search.seconds = int(chosen), None


def _device() -> Any:
    # What the device tells of its memory is the backend's; imported when a
    # search runs, as the train step's loops are.
    from gradaccum._backend import micro_batches

    return micro_batches
