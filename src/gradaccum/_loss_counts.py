"""Loss counts: what Keras divided a micro-batch's loss by, for `model.fit`.

Keras 3 normalizes a loss per batch (`keras.src.losses.loss`):
`"sum_over_batch_size"` divides the batch's summed loss by its number of
entries, or, for a masked loss (`Embedding(mask_zero=True)`), by its number
of valid entries; `"mean_with_sample_weight"` divides by the sum of the
sample weights. A micro-batch's loss is therefore a mean over its own count,
and the mean of `n` such means weighs a micro-batch with 3 valid tokens like
one with 300. Weighing micro-batch `i` by its count `c_i` instead makes the
accumulated update `sum(c_i * g_i) / sum(c_i)` the gradient of the mean over
every entry of the cycle: the large batch's.

The count reaches the optimizer explicitly, within one train step:

1. Keras's `Trainer.compute_loss` is wrapped (for good, once the first
   accumulating optimizer exists; see `gradaccum._patches`). Every train step calls it (`train_step` through
   `_compute_loss`, with `training=True`), in graph, XLA, eager and
   multi-step functions alike, and for each replica; a custom `train_step`
   that calls `self.compute_loss` does too. For a model whose optimizer
   accumulates with `weigh_by="count"` the wrapper records, while the
   original runs, the count of every compiled loss (below).
2. It combines them (`combine`) and hands the result to the optimizer:
   `Weights.count_next` of its core. The train step's `apply` right after weighs
   that micro-batch by it, unless it passes an explicit `weight`. Where no
   loss tells what it divided by (no compiled loss, or only loss functions
   that returned a scalar), nothing is handed over: a micro-step of a split
   train step keeps the count the split handed it, its samples
   (`gradaccum._micro_batches`), any other weighs 1.

Recording: while a count is recorded, `Loss.__call__` and Keras's
`reduce_weighted_values` (the reduction `Loss.__call__` ends with) are
wrapped (`SharedPatch`, only then). The count of each outermost loss call is
`count_of` the arguments of its reduction: the quantity Keras divided by,
computed the way Keras computes it. Losses called inside another loss's
`call` are part of that loss and are not counted on their own.

Several compiled losses (multi-output models) add up as
`sum_k a_k * S_k / c_k`; one weight per micro-batch reproduces the large
batch only when the counts `c_k` are proportional from one micro-batch to
the next. That holds when every loss is a plain mean over a fixed number
of entries per sample (no mask, no `"mean_with_sample_weight"` weights, a
loss shape known beyond the batch axis); their first count is then the
weight. Any other combination weighs every micro-batch alike and warns once
per model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from gradaccum import _backend, _families, _patches

if TYPE_CHECKING:
    from gradaccum._core import Core

# Reductions that divide the summed loss by something.
_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@dataclasses.dataclass(frozen=True)
class Count:
    """What one loss call divided its summed, weighted values by.

    Attributes:
        value: The divisor, a scalar float32 tensor; None if the loss was
            not divided (reduction `"sum"` or none, or a scalar loss).
        per_row: For a plain mean over a fixed number of entries per
            sample, that number (`value` is then the batch size times it);
            else None.
        scalar: Whether the loss was a scalar before Keras's reduction (a
            loss function that took its own mean or sum): what it divided
            by is unknown.
    """

    value: Any | None
    per_row: int | None = None
    scalar: bool = False


def count_of(
    values: Any,
    sample_weight: Any = None,
    mask: Any = None,
    reduction: str | None = "sum_over_batch_size",
    dtype: Any = None,
) -> Count:
    """The count Keras's `reduce_weighted_values` divides by, for its arguments.

    Follows `keras.src.losses.loss.reduce_weighted_values`: the weighted
    values are `values * sample_weight * mask`; `"mean_with_sample_weight"`
    divides their sum by the sum of `sample_weight * mask`; the other means
    divide by the number of entries, where a mask (which Keras folds into the
    weights as `total / valid`) makes that the number of valid entries. Keras
    returns a scalar (or empty) result undivided.

    Args:
        values, sample_weight, mask, reduction, dtype: The arguments Keras's
            `reduce_weighted_values` was called with.

    Returns:
        A `Count`.
    """
    from keras.src import ops
    from keras.src.losses import loss as keras_loss

    reduction = keras_loss.standardize_reduction(reduction)
    if reduction not in _MEANS:
        return Count(None)
    values = ops.convert_to_tensor(values, dtype=dtype)
    # Copies: Keras's `apply_mask` multiplies its arguments in place (`*=`),
    # which on PyTorch would write into the tensors the loss itself was
    # computed from (and break its backward pass).
    if sample_weight is not None:
        sample_weight = ops.copy(ops.convert_to_tensor(sample_weight, dtype=dtype))
    if mask is not None:
        mask = ops.copy(ops.convert_to_tensor(mask, dtype=dtype))
    # Keras's own merge of mask and weights. For `"mean_with_sample_weight"`
    # that is `sample_weight * mask`, whose sum Keras divides by.
    weight = keras_loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
    if weight is not None:
        weight = ops.cast(weight, values.dtype)
        values, weight = keras_loss.squeeze_or_expand_to_same_rank(values, weight)
    static, entries = _backend.for_active().gradients.shape_and_entries(values, weight)
    if static is not None and static in ((), (0,)):
        return Count(None, scalar=True)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        return Count(ops.sum(ops.cast(weight, "float32")))
    if mask is not None:
        # Keras weighs each valid entry `total / valid` and divides by
        # `entries`: the divisor is `entries * valid / total` (`valid` when
        # the mask has the loss's shape).
        valid = ops.sum(ops.cast(mask, "float32"))
        total = ops.cast(ops.size(mask), "float32")
        return Count(ops.divide_no_nan(entries * valid, total))
    per_row = None
    if static is not None and len(static) >= 1 and all(d is not None for d in static[1:]):
        per_row = int(np.prod(static[1:], dtype=np.int64))
    return Count(entries, per_row)


def combine(counts: list[Count]) -> tuple[Any | None, bool]:
    """The weight of a micro-batch whose compiled losses divided by `counts`.

    Returns:
        `(weight, exact)`: `weight` is None for equal weighting. `exact` is
        False when no single weight makes the update the large batch's (see
        the module docstring); the weight is then None.
    """
    if not counts or all(c.value is None for c in counts):
        # No loss divided by anything: every micro-batch weighs alike.
        return None, True
    if len(counts) == 1:
        return counts[0].value, True
    if all(c.per_row is not None for c in counts):
        # Each count is the batch size times a constant: proportional.
        return counts[0].value, True
    return None, False


# ----------------------------------------------------------------------
# Recording, per thread (each replica computes its loss in its own thread).


class _Recording:
    """The counts of one `compute_loss` call."""

    def __init__(self) -> None:
        self.counts: list[Count] = []
        # Nesting of `Loss.__call__`: only depth 1 is a compiled loss.
        self.depth = 0
        # The latest reduction of the current depth-1 loss call: its own
        # reduction is the last one it makes.
        self.latest: Count | None = None


_local = threading.local()


def _recording() -> _Recording | None:
    return getattr(_local, "recording", None)


def loss_call(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    recording = _recording()
    if recording is None:
        return wrapped(*args, **kwargs)
    recording.depth += 1
    if recording.depth == 1:
        recording.latest = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        if recording.depth == 1 and recording.latest is not None:
            recording.counts.append(recording.latest)
        recording.depth -= 1


def reduce(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    recording = _recording()
    if recording is not None and recording.depth == 1:
        recording.latest = count_of(*args, **kwargs)
    return result


# Models already warned about (see `_warn_inexact`).
_warned: weakref.WeakSet = weakref.WeakSet()


def _warn_inexact(model: Any, counts: list[Count]) -> None:
    if model in _warned:
        return
    _warned.add(model)
    warnings.warn(
        f"gradaccum: this model's {len(counts)} compiled losses divide each "
        "micro-batch by counts that need not be proportional (a mask, "
        "'mean_with_sample_weight', or a loss shape that varies beyond the "
        "batch axis), and no single weight per micro-batch makes the update "
        "equal the large batch's. Every micro-batch weighs alike, as with "
        "accumulate(..., weigh_by='batch'). To choose the weight yourself, "
        "call optimizer.apply(grads, weight=...) from a custom train_step.",
        stacklevel=3,
    )


@_backend.unconverted
def _counting(model: Any, args: tuple, kwargs: dict) -> Core | None:
    """The core to hand this loss's count to, if any."""
    # `compute_loss(x, y, y_pred, sample_weight, training=True)`.
    training = kwargs.get("training", args[4] if len(args) > 4 else True)
    if not training or _recording() is not None:
        return None
    core = _families.core_in(getattr(model, "optimizer", None))
    if core is None or core.settings.weigh_by != "count":
        return None
    return core


@contextlib.contextmanager
def recorded() -> Iterator[_Recording]:
    """Records the counts of the compiled losses computed within the block
    (in this thread); `combine(recording.counts)` is their weight. The
    `compute_loss` wrapper hands nothing over meanwhile."""
    recording = _Recording()
    _local.recording = recording
    patches = [_patches.shared("loss.call"), _patches.shared("loss.reduce")]
    for patch in patches:
        patch.acquire()
    try:
        yield recording
    finally:
        for patch in patches:
            patch.release()
        _local.recording = None


def compute_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `Trainer.compute_loss`, handing the loss's count to the
    model's accumulating optimizer (see the module docstring)."""
    core = _counting(instance, args, kwargs)
    if core is None:
        return wrapped(*args, **kwargs)
    return _counted(core, wrapped, instance, args, kwargs)


@_backend.unconverted
def _counted(core: Core, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    with recorded() as recording:
        loss = wrapped(*args, **kwargs)
    weight, exact = combine(recording.counts)
    if not exact:
        _warn_inexact(instance, recording.counts)
    if weight is not None or not all(c.scalar for c in recording.counts):
        # Else no loss told what it divided by: a split train step's
        # micro-batch keeps the weight it handed over, its samples.
        core.weights.count_next(weight)
    return loss
