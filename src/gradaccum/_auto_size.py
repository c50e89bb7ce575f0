"""`micro_batch_size="auto"`: the search for the largest micro-batch whose train step fits.

One `Search` per accumulating core holds the size the train step is traced
with. It is chosen on the first batch of `fit` (`start`):

- JAX, and TensorFlow with `jit_compile=True`: predicted before running,
  from XLA's compiled memory analysis of the train step
  (`_backend.memory.step_bytes`): the step split into halves is
  measured; if it fits, the whole batch is measured too; if not, the step
  split into quarters, and a line through the two split steps gives the
  largest size under the limit. At most 2 compilations; a size below a
  quarter is extrapolated, and the out-of-memory retry is the fallback.
- TensorFlow without XLA and PyTorch: probed: the whole batch first.

With several JAX processes, all trace the smallest size any of them chose
(`_agreed`); a step that runs out of memory anyway raises there.

Sizes are balanced (`balanced`): the fewest micro-batches `k` that fit and
divide the batch (any int, not only powers of two), else `ceil(B / k)` with
a ragged last one. Where a step runs out of memory anyway, the same batch
runs again with more micro-batches (`smaller`), never fewer later. Under a
`tf.distribute` strategy a size counts the samples over all replicas (as
`micro_batch_size=m` does), a multiple of their number (`unit`): the search
runs on a replica's share of the batch, probed; under JAX's
`keras.distribution`, sizes are multiples of the devices the batch is split
over, so that each computes its own gradients. The size is logged once
(logger `"gradaccum"`, at INFO) and read by `opt.micro_batch_size`; configs keep it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

_LOG = logging.getLogger("gradaccum")


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
        self.unit = 1

    def start(self, batch: int, measure: Callable[[int], int] | None, unit: int = 1) -> int:
        """Chooses the size for batches of `batch` samples, where none is
        (or the one a config gave is not a multiple of `unit`).

        Args:
            batch: The batch's samples (over all replicas).
            measure: The bytes of the step at a given size (one compilation
                each), or None where the backend cannot tell (probing).
            unit: The replicas (or JAX's devices along the batch axis)
                that each compute an equal share of a micro-batch: every
                size is a multiple of it.

        Returns:
            The size.

        Raises:
            MemoryError: If the step does not fit even at micro-batches of 1
                sample a replica.
        """
        self.unit = unit
        if self.size is None or self.size % unit:
            share = -(-batch // unit)
            if measure is None and self.limit is not None:
                warnings.warn(
                    f"micro_batch_size=\"auto\": memory_limit={self.limit} predicts the size on JAX and on "
                    "TensorFlow with jit_compile=True only; "
                    "here the size is probed, from the whole batch down where the device runs out of memory.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            size = self._agreed(
                lambda: share if measure is None else self._predicted(share, lambda s: measure(s * unit))
            )
            self._choose(size * unit, "predicted" if measure is not None else "probed from the batch")
        return self.size

    @staticmethod
    def _agreed(choose: Callable[[], int]) -> int:
        """The smallest of the sizes `choose()` gives on each of JAX's
        processes, so that all trace one step before its first collective.
        A process whose step does not fit at all agrees on 0 before raising:
        the others raise too instead of waiting for it."""
        try:
            size = choose()
        except MemoryError:
            _device().agreed(0)
            raise
        size = _device().agreed(size)
        if size < 1:
            raise MemoryError(
                "micro_batch_size=\"auto\": another process's train step does not fit even at micro-batches of "
                "1 sample (its error says what it needs), so no process trains."
            )
        return size

    def smaller(self, batch: int, error: BaseException) -> int:
        """The size after a step with `size` ran out of memory: one
        micro-batch more for the same batch (of `batch` samples over all
        replicas; a multiple of `unit`, as `start` was given).

        Raises:
            MemoryError: If the size is 1 sample a replica already, saying
                what the device has; chained to `error`.
        """
        # Counted in a replica's share of the batch (the whole batch on one).
        unit = self.unit
        share = -(-batch // unit)
        size = min((self.size or batch) // unit, share)
        if _device().several_processes():
            # The other processes may be inside the step they agreed on,
            # waiting for this one in its collectives: a step traced anew
            # here would never match theirs.
            raise MemoryError(
                f"micro_batch_size=\"auto\": the train step ran out of memory on this process at micro-batches "
                f"of {size} samples, and with several JAX processes it cannot run again smaller on one of them. "
                "Pass micro_batch_size=m (a size that fits on every process), or a smaller memory_limit=... "
                f"for the prediction. The device said: {error}"
            ) from error
        if size <= 1:
            smallest = "1 sample" if unit == 1 else f"{unit} samples (1 a replica, each on its own device)"
            raise MemoryError(
                f"micro_batch_size=\"auto\": the train step does not fit even at micro-batches of {smallest}; "
                f"{self._has()} The device said: {error}"
            ) from error
        count = math.ceil(share / size) + 1
        while balanced(share, math.ceil(share / count)) >= size:
            count += 1
        self._choose(unit * balanced(share, math.ceil(share / count)), f"after running out of memory at {size * unit}")
        return self.size

    def _predicted(self, batch: int, measure: Callable[[int], int]) -> int:
        limit = self.limit if self.limit is not None else _memory().free_bytes()
        if limit is None:
            return batch
        if batch == 1:
            single = self._measure(measure, 1)
            return 1 if single <= limit else self._refuse(single, limit)
        # Split steps (a loop over micro-batches) grow by about a constant
        # per sample; the whole batch, traced without the loop, is off that
        # line, so the line goes through two split steps: halves, quarters.
        half = batch // 2
        at_half = self._measure(measure, half)
        if at_half <= limit:
            return batch if self._measure(measure, batch) <= limit else balanced(batch, half)
        quarter = batch // 4
        if quarter == 0:
            self._refuse(at_half, limit)
        at_quarter = self._measure(measure, quarter)
        slope = (at_half - at_quarter) / (half - quarter)
        if slope <= 0:
            return balanced(batch, quarter) if at_quarter <= limit else self._refuse(at_quarter, limit)
        size = min(half - 1, int(quarter + (limit - at_quarter) // slope))
        if size < 1:
            self._refuse(at_quarter - slope * (quarter - 1), limit)
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
        free = _memory().free_bytes()
        return "" if free is None else f"the device has {free} bytes free."

    def _choose(self, size: int, how: str) -> None:
        if size != self.size:
            _LOG.info("gradaccum: micro_batch_size=\"auto\" chose %d (%s).", size, how)
        self.size = size


def search_of(core: Any) -> Search:
    """The search of `core` (whose `micro_batch_size` is `"auto"`)."""
    if core.auto_size is None:
        core.auto_size = Search(core.settings.memory_limit)
    return core.auto_size


def size_of(core: Any) -> int | str | None:
    """What `opt.micro_batch_size` reads: the setting, or with `"auto"` the
    size chosen (`"auto"` until a step chose one)."""
    size = core.settings.micro_batch_size
    if size != "auto":
        return size
    search = core.auto_size
    return "auto" if search is None or search.size is None else search.size


def restore(core: Any, chosen: Any) -> None:
    """Gives `core` the size a config recorded (None: nothing to restore)."""
    if chosen is not None and core.settings.micro_batch_size == "auto":
        search_of(core).size = int(chosen)


def _device() -> Any:
    # How JAX's processes agree is the backend's; imported when a search
    # runs, as the train step's loops are.
    from gradaccum._backend import micro_batches

    return micro_batches


def _memory() -> Any:
    # What the device tells of its memory is the backend's (imported on use).
    from gradaccum._backend import memory

    return memory
