"""`AccumulationState`: the public, read-only view of the accumulation state."""

from __future__ import annotations

from typing import Any, NamedTuple


class AccumulationState(NamedTuple):
    """A read-only view of an `AccumulatingOptimizer`'s accumulation state.

    The end of a cycle does not clear the accumulators and the weight
    total: the next cycle's first micro-step writes over them. Taking the
    view eagerly makes them read as documented below: between cycles
    (`micro_step == 0`) it zeroes them. Inside a traced function the raw
    values are seen.

    Attributes:
        variables: The variables gradients are accumulated for, in the order
            the optimizer met them (checkpoints hold the accumulators in this
            order).
        accumulators: One variable per entry of `variables`: the sum of its
            (weighted) micro-gradients in the current cycle (float32, or
            float64 for float64 variables); for a variable Keras marks
            `overwrite_with_gradient`, their elementwise maximum. Under a
            distribution strategy, replica-local: each replica holds its own.
        micro_step: Micro-batches accumulated in the current cycle (int64 on
            TensorFlow, int32 on JAX and PyTorch).
        weight_total: The sum of the micro-batch weights in the current
            cycle (each unweighted micro-batch weighs 1); replica-local.
        kept_slices: On TensorFlow, unless `sparse="rows"`: the current
            cycle's `tf.IndexedSlices` of each variable whose slices are
            kept, by its position in `variables`, as a `(values, indices)`
            pair of tensors, undivided, every replica's together: slices
            summed over the cycle first (one per index, a position
            embedding's), then those kept side by side (a token
            embedding's, `micro_step` times a micro-step's slices). A
            snapshot taken eagerly, empty inside a traced function; the
            variable's `accumulators` entry stays zero.
        noise_scale: With `noise_scale=True`, the latest estimate of the
            gradient noise scale B_simple (as `AccumulatingOptimizer.noise_scale`);
            None before a cycle has been measured, with `noise_scale=False`,
            or where the view is taken inside a traced function.
        gradient_sq: The moving average of the estimates of |G|², the true
            gradient's squared norm (None as `noise_scale`).
        gradient_trace: The moving average of the estimates of tr(Σ), the
            trace of the per-sample gradient covariance (None likewise).
        noise_batch: The mean micro-batch weight of the latest cycle
            measured (under a distribution strategy, the global micro-batch's).
        noise_cycles: Cycles measured so far (None likewise).
        n: The current cycle's `n` (with a schedule, what it chose; None
            where the view is taken inside a traced function).
    """

    variables: tuple[Any, ...]
    accumulators: tuple[Any, ...]
    micro_step: Any
    weight_total: Any
    kept_slices: dict[int, tuple[Any, Any]] = {}
    noise_scale: float | None = None
    gradient_sq: float | None = None
    gradient_trace: float | None = None
    noise_batch: float | None = None
    noise_cycles: int | None = None
    n: int | None = None
