"""What keeping a split step all or nothing costs per step (`micro_batch_size=m`).

    KERAS_BACKEND=tensorflow python benchmarks/split_put_back.py [--rounds R] [--batches K] [--eager]
    KERAS_BACKEND=torch python benchmarks/split_put_back.py

Before each call of its train function, `fit` with `micro_batch_size=m`
keeps the values of what a split step writes before its update (the model's
non-trainable and metric variables, the optimizer's scalars, the
accumulation's counters), to put them back if the step raises
(`gradaccum._micro_batches.Undone`), where the step runs eagerly (PyTorch,
TensorFlow's `run_eagerly=True`); in a `tf.function` it is wrapped here
only to measure what keeping it there would cost. Four BatchNormalization layers (8
statistics), Keras's loss tracker and one metric: 16 variables kept per
step, about what a ResNet-18 block stack has per 8 layers.

Three variants of the same model (4 x [Dense 64, BatchNormalization], 10
outputs; Adam; B = 64, m = 16), each compiled once: `put back` (as shipped),
a second identical `put back (A/A)` (its distance from 1.00 is the noise),
and `not kept`, whose train function runs Keras's directly. Each round fits
every variant on `K` batches (default 32), in an order rotated per round
(`bench.rotated`), and takes the process CPU time and the wall time of each;
ratios to `not kept` are per round, reported as the median with a 95%
bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench import _bootstrap_ci, _median, rotated  # noqa: E402

from gradaccum import accumulate  # noqa: E402
from gradaccum._micro_batches import Undone  # noqa: E402

B, M = 64, 16


class _NotKept(Undone):
    """Keras's train function, run without keeping anything."""

    def __call__(self, *args):
        return self.function(*args)


def _core(model):
    from gradaccum._families import core_in

    return core_in(model.optimizer)


def _model(eager: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((32,))]
    for _ in range(4):
        layers += [keras.layers.Dense(64, activation="relu"), keras.layers.BatchNormalization()]
    model = keras.Sequential([*layers, keras.layers.Dense(10)])
    model.compile(optimizer=accumulate(keras.optimizers.Adam(1e-3), micro_batch_size=M), loss="mse",
                  metrics=["mae"], run_eagerly=eager)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batches * B, 32)).astype("float32")
    y = rng.normal(size=(args.batches * B, 10)).astype("float32")
    variants = {name: _model(args.eager) for name in ("put back", "put back (A/A)", "not kept")}
    for name, model in variants.items():
        model.fit(x[:B], y[:B], batch_size=B, verbose=0)  # traced once
        function = model.train_function
        inner = function.function if isinstance(function, Undone) else function
        # A `tf.function`'s split step is not kept as shipped: wrapped here to
        # measure what keeping it would cost.
        model.train_function = (_NotKept if name == "not kept" else Undone)(model, _core(model), inner)
    cpu = {name: [] for name in variants}
    wall = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in rotated(list(variants), r):
            c, w = time.process_time(), time.perf_counter()
            variants[name].fit(x, y, batch_size=B, shuffle=False, verbose=0)
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    base = np.array(cpu["not kept"])
    print(f"{keras.backend.backend()}{' eager' if args.eager else ''}: B={B}, m={M}, {args.batches} batches "
          f"per round, {args.rounds} rounds; not kept: {1e3 * np.median(base) / args.batches:.2f} ms CPU per step")
    for name in variants:
        ratio = np.array(cpu[name]) / base
        low, high = _bootstrap_ci([ratio], _median)
        walls = np.median(np.array(wall[name]) / np.array(wall["not kept"]))
        print(f"  {name:16} CPU {np.median(ratio):.3f} [{low:.3f}-{high:.3f}]  wall {walls:.3f}")


if __name__ == "__main__":
    main()
