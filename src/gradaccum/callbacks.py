"""Keras callbacks for accumulating optimizers."""

from __future__ import annotations

from typing import Any

import keras

from gradaccum._families import core_in

_WHEN = ("epoch_end", "train_end")


class FlushPartialCycle(keras.callbacks.Callback):
    """Applies a partial accumulation cycle at the end of each epoch or of training.

    Without it, micro-batches left over at the end of an epoch stay in the
    accumulators and count towards the next epoch's first update (and at the
    end of training they are never applied). With it, what has been
    accumulated is applied as the mean over the micro-batches actually
    accumulated (see `AccumulatingOptimizer.flush`).

    Args:
        at: `"epoch_end"` (default) or `"train_end"`.

    Raises:
        ValueError: If `at` is neither, or, when called, if the model's
            optimizer is not accumulating.
    """

    def __init__(self, at: str = "epoch_end"):
        super().__init__()
        if at not in _WHEN:
            raise ValueError(f"`at` must be one of {_WHEN}. Received: at={at!r}.")
        self.at = at

    def _flush(self) -> None:
        core = core_in(getattr(self.model, "optimizer", None))
        if core is None:
            raise ValueError(
                "FlushPartialCycle needs a model compiled with an accumulating "
                "optimizer (gradaccum.accumulate); this model's optimizer is "
                f"{getattr(self.model, 'optimizer', None)!r}."
            )
        core.flush()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.at == "epoch_end":
            self._flush()

    def on_train_end(self, logs: Any = None) -> None:
        if self.at == "train_end":
            self._flush()
