"""Schedules of `n` for `gradaccum.accumulate`."""

from __future__ import annotations

from gradaccum._adaptive import NoiseScaleSchedule

__all__ = ["NoiseScaleSchedule", "from_noise_scale"]


def from_noise_scale(min_n: int, max_n: int, hysteresis: float = 0.25) -> NoiseScaleSchedule:
    """`n` that follows the measured gradient noise scale.

    After each cycle, the next cycle's `n` becomes about B_simple / B: the
    measured noise scale (see `accumulate(noise_scale=True)`, which this
    schedule turns on) over the mean micro-batch weight B, rounded and
    clipped to [`min_n`, `max_n`]. It changes only between cycles, and
    only where the wanted `n` is more than `1 + hysteresis` times larger or
    smaller than the current one, so that the noise of the estimate does not
    make it flicker. Cycles start at `min_n` until one has been measured.
    Every cycle is still the large batch of its own size.

    ```python
    opt = gradaccum.accumulate(
        keras.optimizers.Adam(1e-3), n=gradaccum.schedules.from_noise_scale(min_n=2, max_n=64)
    )
    ```

    Reading the chosen `n` costs PyTorch, which keeps the cycle's position
    on the host, one read from the device per cycle. Under a TensorFlow
    distribution strategy with several replicas, each measures its own
    micro-batches and all choose together from the estimates averaged over
    replicas, at the cost of an all-reduce of four scalars per micro-step.

    Args:
        min_n: The smallest `n`, an int >= 2 (a cycle of one micro-batch
            cannot measure the noise scale).
        max_n: The largest `n`, an int >= `min_n`.
        hysteresis: A number >= 0 (default 0.25).

    Returns:
        A schedule to pass as `n`.

    Raises:
        TypeError: If `min_n` or `max_n` is not an int, or `hysteresis` not
            a number.
        ValueError: If `min_n < 2`, `max_n < min_n`, `max_n` is above what
            the cycle's counters hold, or `hysteresis < 0`.
    """
    return NoiseScaleSchedule(min_n, max_n, hysteresis)
