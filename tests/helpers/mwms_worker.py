"""One worker of a two-process MultiWorkerMirroredStrategy run (for tests).

Started by `tests/distribution/test_multi_worker_tensorflow.py` with `TF_CONFIG` naming two workers on
127.0.0.1. Trains `accumulate(Adam, n)` with a custom `strategy.run` loop and
then with `model.fit`, records this worker's variables after every
micro-step, and writes everything to the `.npz` file named on the command
line. Keras 3.15's `model.fit` cannot run under MultiWorkerMirroredStrategy
at all (its symbolic build reduces the first batch with `strategy.reduce`,
which fails for any model and optimizer); the worker then records the
traceback under `fit/error` for the test to check. Last it makes the train
function of a model whose optimizer has `micro_batch_size="auto"`, which
several workers refuse, and records the error under `auto/error`.

    python -m tests.helpers.mwms_worker OUTPUT.npz
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradaccum import accumulate  # noqa: E402
from tests.helpers import make_data, make_mlp  # noqa: E402
from tests.helpers.distribute import (  # noqa: E402
    custom_loop,
    distributed_batches,
    replica_accumulators,
    replica_states,
)

N = 3
MICRO_BATCH = 4  # global: 2 samples per worker
CYCLES = 3
LR = 1e-2


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(LR)


def data() -> tuple[np.ndarray, np.ndarray]:
    return make_data(MICRO_BATCH * N * CYCLES)


def _run(strategy: tf.distribute.Strategy, mode: str) -> dict[str, np.ndarray]:
    """Trains one epoch in `mode`; returns this worker's snapshots, flattened."""
    x, y = data()
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), N)
        optimizer.build(model.trainable_variables)
    snapshots = []

    def record(*_):
        (state,) = replica_states(strategy, model, optimizer)
        (accumulators,) = replica_accumulators(strategy, optimizer)
        snapshots.append((state, accumulators))

    record()
    if mode == "fit":
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(
            distributed_batches(strategy, x, y, MICRO_BATCH),
            epochs=1,
            verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=record)],
        )
    else:
        custom_loop(strategy, model, optimizer, x, y, MICRO_BATCH, on_step=record)
    out = {}
    for t, (state, accumulators) in enumerate(snapshots):
        for key, value in state.items():
            out[f"{mode}/{t}/{key}"] = value
        for i, value in enumerate(accumulators):
            out[f"{mode}/{t}/accumulator/{i}"] = value
    return out


def _auto_train_function(strategy: tf.distribute.Strategy) -> None:
    """Makes the train function of `fit` with `micro_batch_size="auto"`
    (which `fit` itself does not reach here: see above)."""
    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(make_optimizer(), micro_batch_size="auto")
    model.compile(optimizer=optimizer, loss="mse")
    model.make_train_function()


def main(path: str) -> None:
    # The strategy must exist before TensorFlow runs anything else.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    results = _run(strategy, "custom_loop")
    keras.config.disable_traceback_filtering()  # report where fit fails
    try:
        results.update(_run(strategy, "fit"))
    except Exception:  # noqa: BLE001 -- reported to the test, which decides
        results["fit/error"] = np.asarray(traceback.format_exc())
    try:
        _auto_train_function(strategy)
    except ValueError as error:
        results["auto/error"] = np.asarray(str(error))
    np.savez(path, **results)


if __name__ == "__main__":
    main(sys.argv[1])
