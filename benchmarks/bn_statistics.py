"""BatchNormalization's moving statistics under gradient accumulation.

    python benchmarks/bn_statistics.py            # 3 seeds (a few minutes on 2 cores)
    python benchmarks/bn_statistics.py --seeds 1  # quicker

A small conv net with four BatchNormalization layers (one on the input,
three after convolutions and a dense layer) learns scikit-learn's 8x8 digits
(1,437 training and 360 test images). Four runs per seed, from the same
initial weights, on the same data order:

- "large batch": Keras's layer, the plain optimizer on batches of `B * n`
  (the reference);
- "Keras layer": Keras's layer under `accumulate(optimizer, n)` on
  micro-batches of `B` (moving statistics updated on every micro-batch);
- "mean of variances": the rule of the gradient-accumulator package's
  `AccumBatchNormalization`, moving statistics updated once per cycle with
  the mean of the micro-batch means and the mean of the micro-batch
  variances (no spread between micro-batch means);
- "gradaccum layer": `gradaccum.layers.BatchNormalization`, once per cycle
  with the pooled statistics of the cycle.

For each BatchNormalization layer it reports, relative to the size of the
statistic compared with (`||s - r|| / ||r||`):

1. the distance of the moving mean and variance from the large-batch run's.
   The input layer's statistics depend on the data only, so there the
   distance measures the pooling rule alone. Deeper layers also see that in
   training each micro-batch is normalized with its own statistics (which
   all three accumulating runs share), and the weights that follow from it:
   there the runs drift apart whatever the rule.
2. the distance of the moving mean and variance from the statistics the
   trained network's own activations have over the whole training set, in
   inference mode (what the moving statistics stand in for when the model
   is evaluated). This isolates the rule in every layer.

and every run's test accuracy in inference mode.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from gradaccum import accumulate  # noqa: E402
from gradaccum.layers import BatchNormalization  # noqa: E402

B, N, EPOCHS, MOMENTUM = 4, 8, 6, 0.9
LAYERS = ("bn_input", "bn_conv1", "bn_conv2", "bn_dense")


class MeanOfVariances(BatchNormalization):
    """The gradient-accumulator package's pooling rule, in this layer's
    machinery: equal weights per micro-batch, the mean of their variances."""

    def _pool(self, mean, variance, count, last):
        k = self.pooled_count.value  # micro-batches pooled so far
        mean_a = self.pooled_mean.value
        variance_a = tf.math.divide_no_nan(self.pooled_m2.value, k)
        total = k + 1.0
        pooled_mean = mean_a + (mean - mean_a) / total
        pooled_variance = variance_a + (variance - variance_a) / total
        self._finish(total, pooled_mean, pooled_variance * total, last)


def make_model(bn, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            bn(momentum=MOMENTUM, name="bn_input"),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="conv1"),
            bn(momentum=MOMENTUM, name="bn_conv1"),
            keras.layers.ReLU(),
            keras.layers.Conv2D(32, 3, strides=2, use_bias=False, name="conv2"),
            bn(momentum=MOMENTUM, name="bn_conv2"),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, use_bias=False, name="dense"),
            bn(momentum=MOMENTUM, name="bn_dense"),
            keras.layers.ReLU(),
            keras.layers.Dense(10, name="logits"),
        ],
        name="digits",
    )


def data(seed):
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[360:], y[360:]), (x[:360], y[:360])


def train(bn, batch, n, seed, train_data):
    model = make_model(bn, seed)
    optimizer = keras.optimizers.Adam(3e-3)
    if n > 1:
        optimizer = accumulate(optimizer, n)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = train_data
    model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def moving(model, name):
    layer = model.get_layer(name)
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def population(model, name, x):
    """Mean and (biased) variance of what reaches layer `name` over `x`, in
    inference mode."""
    probe = keras.Model(model.inputs[0], model.get_layer(name).input)
    h = np.asarray(probe(x, training=False))
    axes = tuple(range(h.ndim - 1))
    return h.mean(axis=axes), h.var(axis=axes)


def relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    runs = {
        "Keras layer": (keras.layers.BatchNormalization, B, N),
        "mean of variances": (MeanOfVariances, B, N),
        "gradaccum layer": (BatchNormalization, B, N),
    }
    rows: dict[str, list] = {name: [] for name in ["large batch", *runs]}
    for seed in range(args.seeds):
        train_data, test_data = data(seed)
        # Trim to whole cycles, so every run applies the same updates.
        cycle = B * N
        keep = len(train_data[0]) // cycle * cycle
        train_data = (train_data[0][:keep], train_data[1][:keep])
        reference = train(keras.layers.BatchNormalization, B * N, 1, seed, train_data)
        def own(model):
            out = []
            for layer in LAYERS:
                (m, v), (pm, pv) = moving(model, layer), population(model, layer, train_data[0])
                out.append((relative(m, pm), relative(v, pv)))
            return out

        rows["large batch"].append(
            ([(0.0, 0.0)] * len(LAYERS), own(reference), reference.evaluate(*test_data, verbose=0)[1])
        )
        for name, (bn, batch, n) in runs.items():
            model = train(bn, batch, n, seed, train_data)
            distances = []
            for layer in LAYERS:
                (m, v), (rm, rv) = moving(model, layer), moving(reference, layer)
                distances.append((relative(m, rm), relative(v, rv)))
            rows[name].append((distances, own(model), model.evaluate(*test_data, verbose=0)[1]))
        print(f"seed {seed} done", flush=True)

    print(f"\nB={B}, n={N} (large batch {B * N}), momentum {MOMENTUM}, {EPOCHS} epochs, "
          f"Adam 3e-3, {args.seeds} seeds. Relative distance of the moving mean / moving "
          "variance (mean over seeds); test accuracy: mean (min-max over seeds).\n")
    for title, k in (("from the large-batch run's moving statistics", 0),
                     ("from the statistics of the network's own activations (inference mode)", 1)):
        print(f"Distance {title}:\n")
        print("| run | " + " | ".join(LAYERS) + (" | test accuracy |" if k else " |"))
        print("|" + "---|" * (len(LAYERS) + 1 + bool(k)))
        for name, results in rows.items():
            cells = []
            for j in range(len(LAYERS)):
                mean_d = np.mean([r[k][j][0] for r in results])
                var_d = np.mean([r[k][j][1] for r in results])
                cells.append(f"{mean_d:.2g} / {var_d:.2g}")
            if k:
                accuracies = [r[2] for r in results]
                cells.append(
                    f"{np.mean(accuracies):.3f} ({min(accuracies):.3f}-{max(accuracies):.3f})"
                )
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
