"""`n` chosen from the measured gradient noise scale.

McCandlish et al. 2018 find the most efficient batch near the noise scale
B_simple: training on much smaller batches wastes steps, on much larger
ones wastes samples. `NoiseScaleSchedule` (`gradaccum.schedules.from_noise_scale`)
sets each cycle's `n` to about B_simple / B, with B the mean micro-batch
weight, so that the large batch follows the noise scale as it grows during
training. The decision is made on the device, in the branch that ends a
cycle (`gradaccum._noise.Noise.measure`), and read by `gradaccum._cycle.Cycle`
as the next cycle's `n`: it changes only between cycles.
"""

from __future__ import annotations

import numbers
from typing import Any

import keras
from keras import ops

from gradaccum._validation import check_n


@keras.saving.register_keras_serializable(package="gradaccum", name="NoiseScaleSchedule")
class NoiseScaleSchedule:
    """A schedule of `n` that follows the measured gradient noise scale.

    Create it with `gradaccum.schedules.from_noise_scale`, which documents
    the arguments.

    Raises:
        TypeError: If `min_n` or `max_n` is not an int, or `hysteresis` not
            a number.
        ValueError: If `min_n < 2`, `max_n < min_n`, `max_n` is above what
            the cycle's counters hold, or `hysteresis < 0`.
    """

    def __init__(self, min_n: int, max_n: int, hysteresis: float = 0.25):
        for name, value in (("min_n", min_n), ("max_n", max_n)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"`{name}` must be an integer >= 2 (micro-batches per update). "
                    f"Received: {name}={value!r} of type {type(value).__name__}."
                )
        if min_n < 2:
            raise ValueError(
                "`min_n` must be an integer >= 2: a cycle of one micro-batch has one batch size "
                f"only and cannot measure the noise scale that sets the next `n`. Received: min_n={min_n!r}."
            )
        if max_n < min_n:
            raise ValueError(
                f"`max_n` must be >= `min_n`. Received: min_n={min_n!r}, max_n={max_n!r}."
            )
        try:
            check_n(max_n)
        except ValueError as error:
            raise ValueError(f"`max_n` is the largest `n`: {error}") from None
        expected = (
            "`hysteresis` must be a number >= 0: `n` changes only once the noise scale asks for "
            f"one more than (1 + hysteresis) times larger or smaller. Received: hysteresis={hysteresis!r}"
        )
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Real):
            raise TypeError(f"{expected} of type {type(hysteresis).__name__}.")
        if not hysteresis >= 0:
            raise ValueError(f"{expected}.")
        self.min_n, self.max_n, self.hysteresis = int(min_n), int(max_n), float(hysteresis)

    def __call__(self, applied: Any) -> int:
        """`min_n`: what a cycle before any measurement uses. The core reads
        the measured choice itself (`next_n`)."""
        return self.min_n

    def next_n(self, current: Any, gradient_sq: Any, trace: Any, batch: Any) -> Any:
        """The next cycle's `n` (float32 tensor) from the current one and the
        estimates of |G|² and tr(Σ) (their moving averages: the ratio needs
        no correction) and the mean micro-batch weight `batch`."""
        current = ops.clip(current, float(self.min_n), float(self.max_n))
        # |G|² not yet resolved (<= 0): the noise dominates, the largest n.
        resolved = gradient_sq > 0
        ratio = ops.where(resolved, trace / ops.where(resolved, gradient_sq, 1.0), float(self.max_n) * batch)
        wanted = ops.clip(ops.round(ratio / ops.maximum(batch, 1e-12)), float(self.min_n), float(self.max_n))
        band = 1.0 + self.hysteresis
        moves = ops.logical_or(wanted > current * band, wanted * band < current)
        return ops.where(moves, wanted, current)

    def get_config(self) -> dict[str, Any]:
        return {"min_n": self.min_n, "max_n": self.max_n, "hysteresis": self.hysteresis}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NoiseScaleSchedule:
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoiseScaleSchedule) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(tuple(self.get_config().items()))

    def __repr__(self) -> str:
        return f"from_noise_scale(min_n={self.min_n}, max_n={self.max_n}, hysteresis={self.hysteresis})"
