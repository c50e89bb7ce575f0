"""`accumulate()`: the one-line entry point."""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras
import tensorflow as tf

from gradaccum import _loss_counts, _saving
from gradaccum._loss_scale import LossScaleFront  # noqa: F401  (registers the kind)
from gradaccum._proxy import AccumulatingOptimizer
from gradaccum._validation import check_mode, check_n_or_schedule, check_reduction, check_sparse, check_weigh_by


def accumulate(
    optimizer: keras.optimizers.Optimizer | None = None,
    n: int | Callable[[tf.Tensor], Any] | None = None,
    *,
    reduction: str = "mean",
    mode: str = "masked",
    weigh_by: str = "count",
    sparse: str = "rows",
) -> AccumulatingOptimizer | Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives an optimizer gradient accumulation over `n` micro-batches.

    ```python
    opt = accumulate(keras.optimizers.Adam(1e-3), n=4)
    AccAdam = accumulate(n=4)(keras.optimizers.Adam)   # decorator form
    ```

    Args:
        optimizer: A Keras optimizer instance. Omit it to get a decorator for
            an optimizer class or factory function.
        n: Micro-batches per applied update: an int >= 1, or a schedule (a
            callable of the applied-update count returning the int for the next
            cycle, written with TensorFlow ops; see `AccumulatingOptimizer`).
        reduction: `"mean"` (default) applies the mean of the micro-batch
            gradients, as training on the large batch with a mean-reduced loss
            does; `"sum"` applies their sum (for sum-reduced losses). Weighted
            micro-batches (`apply_gradients(..., weight=w)`) give the weighted
            mean or sum.
        mode: `"masked"` (default) runs the wrapped optimizer's update on
            every micro-step and keeps its result only on the apply step,
            with no branch around it: every micro-step runs the same
            operations, including the optimizer's replica synchronisation.
            `"skip"` runs the update only on the apply step (a `tf.cond`
            decided in cross-replica context, so it works under
            `MirroredStrategy`): in-between micro-steps cost only the
            accumulation. Both give the same result.
        weigh_by: What a micro-batch of `model.fit` weighs in the mean.
            `"count"` (default): the count Keras's loss divided it by (its
            valid entries under a mask, its sum of sample weights for
            `reduction="mean_with_sample_weight"`, its size), so the update
            is the mean over every entry of the cycle, as on the large batch
            (see the README for several losses). `"batch"`: 1, every
            micro-batch alike (Keras's per-batch means, averaged). A
            `weight` passed to `apply_gradients` wins over either.
        sparse: How `tf.IndexedSlices` gradients (an `Embedding`'s) are
            accumulated. `"rows"` (default) adds them into a dense
            accumulator, summing a row's repeated occurrences.
            `"slices"` keeps the cycle's slices (values and indices) and
            hands the optimizer one `tf.IndexedSlices` of all of them, as
            the large batch would: exact also where rows repeat and the
            optimizer is not linear in the gradient (Adam's second moment,
            `global_clipnorm`), at the memory of the cycle's slices (see
            the README). One device only; not under XLA.

    Returns:
        An `AccumulatingOptimizer` around the very `optimizer` passed in, or,
        without `optimizer`, a decorator whose result builds one per call.

    Raises:
        TypeError: If `n` is missing or neither an int nor a callable, or
            `optimizer` is not a Keras optimizer.
        ValueError: If `n < 1`, `reduction`, `mode`, `weigh_by` or `sparse` is
            unknown, `optimizer` already accumulates gradients, or the active
            Keras backend is not TensorFlow.
    """
    if n is None:
        raise TypeError(
            "accumulate() requires `n`, the number of micro-batches per update."
        )
    n = check_n_or_schedule(n)
    reduction = check_reduction(reduction)
    mode = check_mode(mode)
    weigh_by = check_weigh_by(weigh_by)
    sparse = check_sparse(sparse)
    if optimizer is not None:
        return AccumulatingOptimizer(
            optimizer, n, reduction=reduction, mode=mode, weigh_by=weigh_by, sparse=sparse
        )

    def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(factory):
            raise TypeError(
                "accumulate(n=...) decorates an optimizer class or factory "
                f"function. Received: {factory!r} of type "
                f"{type(factory).__name__}."
            )

        @functools.wraps(factory, updated=())
        def make(*args: Any, **kwargs: Any) -> AccumulatingOptimizer:
            return AccumulatingOptimizer(
                factory(*args, **kwargs), n, reduction=reduction, mode=mode,
                weigh_by=weigh_by, sparse=sparse,
            )

        return make

    return decorator


_saving.register(AccumulatingOptimizer)
_loss_counts.install()
