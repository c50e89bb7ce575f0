"""Keras callbacks for accumulating optimizers (Keras 3's and tf_keras's `fit`)."""

from __future__ import annotations

from typing import Any

import keras

from gradaccum._families import core_in

_WHEN = ("epoch_end", "train_end")


class _Callback(keras.callbacks.Callback):
    """A Keras 3 callback that tf_keras's `fit` takes too: tf_keras asks each
    callback which batch hooks it implements, which Keras 3's do not say."""

    def _implements_train_batch_hooks(self) -> bool:
        return type(self).on_train_batch_end is not keras.callbacks.Callback.on_train_batch_end

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False


class FlushPartialCycle(_Callback):
    """Applies a partial accumulation cycle at the end of each epoch or of training.

    Without it, micro-batches left over at the end of an epoch stay in the
    accumulators and count towards the next epoch's first update (and at the
    end of training they are never applied). With it, what has been
    accumulated is applied as the mean over the micro-batches actually
    accumulated (see `AccumulatingOptimizer.flush`).

    Args:
        at: `"epoch_end"` (default) or `"train_end"`.

    Raises:
        TypeError: If `at` is not a string.
        ValueError: If `at` is neither, or, when called, if the model's
            optimizer is not accumulating.
    """

    def __init__(self, at: str = "epoch_end"):
        super().__init__()
        if not isinstance(at, str):
            raise TypeError(f"`at` must be a string, one of {_WHEN}. Received: at={at!r} of type {type(at).__name__}.")
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


class GradientNoiseScale(_Callback):
    """Logs the gradient noise scale an accumulating optimizer measures.

    Adds `noise_scale` (see `AccumulatingOptimizer.noise_scale`), and with
    `estimates=True` also `gradient_sq` (|G|²) and `gradient_trace` (tr(Σ)),
    to the logs of `fit`, so that callbacks after it (`TensorBoard`,
    `CSVLogger`, `History`) record them. List it before those. Nothing is
    logged before a cycle has been measured. Each log reads the estimate
    from the device once.

    ```python
    opt = gradaccum.accumulate(keras.optimizers.Adam(1e-3), n=8, noise_scale=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=32, callbacks=[
        gradaccum.callbacks.GradientNoiseScale(),
        keras.callbacks.TensorBoard("logs"),
    ])
    ```

    Args:
        update_freq: `"epoch"` (default): at the end of each epoch; or an
            int k >= 1: also in the logs of every k-th training batch.
        estimates: Whether to log the estimates of |G|² and tr(Σ) too.

    Raises:
        TypeError: If `update_freq` is neither a string nor an int, or
            `estimates` is not a bool.
        ValueError: If `update_freq` is neither, or, when called, if the
            model's optimizer does not measure the noise scale.
    """

    def __init__(self, update_freq: str | int = "epoch", estimates: bool = False):
        super().__init__()
        if isinstance(update_freq, bool) or not isinstance(update_freq, (str, int)):
            raise TypeError(
                "`update_freq` must be \"epoch\" or an int >= 1. "
                f"Received: update_freq={update_freq!r} of type {type(update_freq).__name__}."
            )
        if not isinstance(estimates, bool):
            raise TypeError(
                "`estimates` must be True (log the estimates of |G|² and tr(Σ) too) or False. "
                f"Received: estimates={estimates!r} of type {type(estimates).__name__}."
            )
        if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int)
                                       or update_freq < 1):
            raise ValueError(f"`update_freq` must be \"epoch\" or an int >= 1. Received: update_freq={update_freq!r}.")
        self.update_freq = update_freq
        self.estimates = estimates

    def _log(self, logs: Any) -> None:
        core = core_in(getattr(self.model, "optimizer", None))
        if core is None or not core.settings.noise_scale:
            raise ValueError(
                "GradientNoiseScale needs a model compiled with an optimizer that measures "
                "the noise scale, gradaccum.accumulate(optimizer, n, noise_scale=True); this "
                f"model's optimizer is {getattr(self.model, 'optimizer', None)!r}."
            )
        if logs is None or core.state is None or core.state.noise is None:
            return
        values = core.state.noise.read()
        if values is None:
            return
        logs["noise_scale"] = values["noise_scale"]
        if self.estimates:
            logs["gradient_sq"] = values["gradient_sq"]
            logs["gradient_trace"] = values["trace"]

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.update_freq != "epoch" and (batch + 1) % self.update_freq == 0:
            self._log(logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._log(logs)
