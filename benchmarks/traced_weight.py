"""A custom loop's micro-step with a traced `weight=` against one without.

    python benchmarks/traced_weight.py [--rounds R] [--steps S] [--width W]

TensorFlow, a `tf.function` without XLA that computes an MLP's gradients
and calls `opt.apply(grads, variables, weight=w)` with `w` a tensor argument
(so the weight's check is traced), against the same step without `weight`.
The two variants (and an A/A copy of the second) take turns in rounds of
`S` in-between micro-steps (n is larger than every round's steps, so no
update runs); per round the ratio of process CPU times; the median and the
smallest and largest over rounds are printed.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradaccum import accumulate  # noqa: E402


def variant(width: int, weighted: bool):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                                         for _ in range(4)] + [keras.layers.Dense(10)])
    opt = accumulate(keras.optimizers.Adam(1e-3), n=10**6)
    opt.build(model.trainable_variables)
    loss = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply(grads, model.trainable_variables, weight=weight if weighted else None)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(32, args.width)).astype("float32"))
    y = tf.constant(rng.normal(size=(32, 10)).astype("float32"))
    weight = tf.constant(1.0)
    steps = {"traced weight": variant(args.width, True), "no weight": variant(args.width, False),
             "no weight (A/A)": variant(args.width, False)}
    for step in steps.values():
        step(x, y, weight)  # traced once, outside the timing
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            for _ in range(args.steps):
                steps[name](x, y, weight)
            times[name].append(time.process_time() - start)
    base = np.array(times["no weight"])
    for name in ("traced weight", "no weight (A/A)"):
        ratios = np.array(times[name]) / base
        print(f"{name} / no weight: {np.median(ratios):.2f} [{ratios.min():.2f}, {ratios.max():.2f}] "
              f"(CPU time, {args.rounds} rounds of {args.steps} micro-steps, width {args.width})")


if __name__ == "__main__":
    main()
