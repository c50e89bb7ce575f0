"""Demo: accumulated micro-batches train exactly like the large batch.

Run with `python -m gradaccum.demo`. It trains a small classifier on
scikit-learn's bundled digits data (no download) three times from the same
initial weights:

- the plain optimizer on batches of 64 (the large batch);
- the plain optimizer on micro-batches of 8 (no accumulation);
- `accumulate(..., n=8)` on micro-batches of 8.

It prints the loss curves of the large batch and of the accumulated run, the
largest relative difference between their final weights, and exits with
status 1 if they disagree beyond float32 rounding. It then says what
accumulation cost: the time per epoch of the accumulated run against plain
training on the same micro-batches (the same forward and backward passes,
one update per micro-batch). Last, the memory the large batch would have
needed for its activations, estimated from the layers' shapes (see
`activation_bytes`), against a micro-batch's, and the memory the
accumulators add.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from gradaccum._quiet import stderr_silenced

# No TensorFlow C++ log lines below errors once its logging has started
# (also where the demo is imported rather than run with `-m`).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Agreement expected from float32 rounding alone: measured 2.4e-7 relative
# after 10 epochs (280 updates) on this model; a real bug is orders larger.
TOLERANCE = 1e-5


def _import_keras():
    """Imports Keras (and its backend) quietly; returns the module.

    Run as `python -m gradaccum.demo`, the package imported Keras silenced
    already (see `gradaccum._quiet`); the first tensor starts a device,
    which logs too.
    """
    with stderr_silenced():
        import keras

        keras.ops.convert_to_numpy(keras.ops.zeros(()))
    # TensorFlow's Python warnings (retracing and the like) go to this logger.
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover - absl comes with TensorFlow and JAX
        pass
    return keras


class _EpochTimer:
    def __init__(self, keras):
        outer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                outer._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                outer.times.append(time.perf_counter() - outer._start)

        self.times: list[float] = []
        self.callback = Callback()

    def per_epoch(self) -> float:
        """The median time of an epoch; the first includes tracing and is
        left out when there are others."""
        rest = sorted(self.times[1:] or self.times)
        return rest[len(rest) // 2]


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - exercised by users only
        sys.exit("The demo needs scikit-learn for its bundled digits data: pip install \".[demo]\"")
    import numpy as np

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    keep = (len(x) // 64) * 64  # whole large batches only
    return x[:keep], y[:keep].astype("int32"), np


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="digits",
    )


def activation_bytes(model, batch_size: int) -> int:
    """Estimated memory of the activations a training step keeps for the
    backward pass: `batch_size` x the elements of every layer's input and
    output x 4 bytes (float32). A lower bound for real frameworks, which
    also keep temporaries; it grows with the batch, while the weights, the
    gradients and the optimizer state do not."""
    per_sample = 0
    for layer in model.layers:
        for shape in (layer.input.shape, layer.output.shape):
            elements = 1
            for dim in shape[1:]:
                elements *= dim
            per_sample += elements
    return batch_size * per_sample * 4


def _train(keras, optimizer, batch_size: int, x, y, epochs: int, seed: int):
    model = _model(keras, seed)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = _EpochTimer(keras)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer.callback]
    )
    return model, history.history["loss"], timer


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--n", type=int, default=8, help="micro-batches per update")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.n < 1 or 64 % args.n:
        parser.error("--epochs must be >= 1 and --n a divisor of 64")

    keras = _import_keras()
    from gradaccum import accumulate

    x, y, np = _load_digits()
    large, micro = 64, 64 // args.n
    ref_model, ref_loss, _ = _train(keras, keras.optimizers.Adam(1e-3), large, x, y, args.epochs, args.seed)
    _, _, plain_timer = _train(keras, keras.optimizers.Adam(1e-3), micro, x, y, args.epochs, args.seed)
    acc_model, acc_loss, acc_timer = _train(
        keras, accumulate(keras.optimizers.Adam(1e-3), n=args.n), micro, x, y, args.epochs, args.seed
    )

    print(f"digits: {len(x)} samples, Adam(1e-3), {args.epochs} epochs, {keras.config.backend()} backend")
    print(f"{'epoch':>5}  {'loss, batch ' + str(large):>16}  {f'loss, {args.n} x {micro} accumulated':>26}")
    for epoch, (a, b) in enumerate(zip(ref_loss, acc_loss), start=1):
        print(f"{epoch:>5}  {a:>16.6f}  {b:>26.6f}")
    rel = max(
        float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-12))
        for a, b in zip(ref_model.get_weights(), acc_model.get_weights())
    )
    print(f"max relative difference of the final weights: {rel:.3e} (tolerance {TOLERANCE:.0e})")

    plain, accumulated = plain_timer.per_epoch(), acc_timer.per_epoch()
    steps = len(x) // micro
    print(
        f"time per epoch on micro-batches of {micro}: plain {plain:.3f} s, accumulated "
        f"{accumulated:.3f} s ({accumulated / plain:.2f}x: the cost of accumulating; a micro-step of "
        f"this small model takes {1000 * plain / steps:.1f} ms, so a fixed cost per step shows)"
    )
    parameters = sum(int(np.prod(w.shape)) for w in ref_model.get_weights())
    print(
        f"activation memory, estimated (batch x each layer's input and output elements x 4 bytes): "
        f"{_kib(activation_bytes(ref_model, large))} for a batch of {large}, "
        f"{_kib(activation_bytes(ref_model, micro))} for a micro-batch of {micro}; the accumulators "
        f"add {_kib(4 * parameters)} (one float32 per parameter, {parameters:,} parameters)"
    )
    if not rel <= TOLERANCE:
        print("FAIL: the accumulated run does not match the large-batch run")
        return 1
    print("OK: accumulated training matches large-batch training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
