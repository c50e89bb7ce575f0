"""gradaccum against Keras's own `gradient_accumulation_steps`: what differs.

    python benchmarks/keras_option.py            # about a minute on 2 CPU cores

Each case trains the same model from the same initial weights three ways,
with `model.fit` on TensorFlow, unshuffled:

- the reference: the plain optimizer on the large batch (`n * B`);
- gradaccum: `accumulate(optimizer, n)` on micro-batches of `B`;
- Keras's option: the optimizer with `gradient_accumulation_steps=n`, on
  micro-batches of `B`.

Each accumulating run is reported as the largest difference of its final
weights from the reference's (`max |w - w_ref|`), and as that difference
over the reference's largest movement (`max |w_ref - w_0|`), so 100% means
"as far from the large batch as the large batch moved".

Cases:

- `ragged`: 60 samples, B=8, n=4: every epoch ends with a cycle of 8, 8, 8
  and 4 samples (the large batch: 32, then 28). 5 epochs; SGD and Adam.
- `masked`: a small causal language model (embedding with `mask_zero=True`,
  a GRU, a per-token classifier) on 96 sequences of 2 to 24 tokens,
  padding masked out of the loss. 3 epochs of SGD, and of Adam with the
  default `sparse="auto"` and with `sparse="rows"` (the embedding's rows
  repeat within a batch; summed into rows, Adam's second moment sees the
  square of their sum instead of the sum of their squares).
- `schedule`: SGD with `ExponentialDecay(0.05, decay_steps=8,
  decay_rate=0.5)` over 16 updates; also the learning rate each variant
  reads on its last update.
- `ema`: Adam with `use_ema=True`, `ema_momentum=0.9`, 16 updates.
- `mirrored`: `MirroredStrategy` over 2 logical CPU devices; gradaccum
  against one device on the concatenated batch, and whether Keras's option
  trains at all (its error, and whether it is a `merge_call` inside a
  conditional).

Nothing here runs in the tests; `tests/keras_parity/test_keras_defects_tensorflow.py` and the
tests of each feature check gradaccum's side of every row.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPUs for MirroredStrategy, before TensorFlow initialises.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from gradaccum import accumulate  # noqa: E402

N, B = 4, 8


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _distance(weights, reference, initial):
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, initial))
    return {"max_abs": diff, "of_movement": diff / moved}


def _three_ways(make_model, make_opt, x, y, loss, epochs, **settings):
    """The distances of gradaccum (with `settings`) and of Keras's option
    from the reference."""
    out = {}
    for variant in ("reference", "gradaccum", "keras"):
        model = make_model()
        initial = _weights(model)
        if variant == "reference":
            opt, batch = make_opt(), N * B
        elif variant == "gradaccum":
            opt, batch = accumulate(make_opt(), N, **settings), B
        else:
            opt, batch = make_opt(gradient_accumulation_steps=N), B
        model.compile(optimizer=opt, loss=loss)
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        out[variant] = _weights(model)
        out["initial"] = initial
    return {v: _distance(out[v], out["reference"], out["initial"]) for v in ("gradaccum", "keras")}


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


def ragged():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(60, 1))).astype("float32")
    return {
        "sgd": _three_ways(_mlp, lambda **kw: keras.optimizers.SGD(0.1, **kw), x, y, "mse", 5),
        "adam": _three_ways(_mlp, lambda **kw: keras.optimizers.Adam(0.01, **kw), x, y, "mse", 5),
    }


def masked():
    rng = np.random.default_rng(1)
    vocab, length, samples = 50, 24, 96
    tokens = np.zeros((samples, length + 1), "int32")
    for i, size in enumerate(rng.integers(3, length + 2, size=samples)):
        tokens[i, :size] = rng.integers(1, vocab, size=size)
    x, y = tokens[:, :-1], tokens[:, 1:]
    x = np.where(y == 0, 0, x)  # no target: masked out

    def lm():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, 16, mask_zero=True),
            keras.layers.GRU(32, return_sequences=True),
            keras.layers.Dense(vocab),
        ])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return {
        "sgd": _three_ways(lm, lambda **kw: keras.optimizers.SGD(0.5, **kw), x, y, loss, 3),
        # The embedding's gradient is a `tf.IndexedSlices` whose rows repeat;
        # under Adam the default keeps them as slices, exact, and "rows" is
        # not (see the sparse guide).
        "adam": _three_ways(lm, lambda **kw: keras.optimizers.Adam(0.01, **kw), x, y, loss, 3),
        "adam, sparse='rows'": _three_ways(
            lm, lambda **kw: keras.optimizers.Adam(0.01, **kw), x, y, loss, 3, sparse="rows"
        ),
    }


def _regression(samples):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def schedule():
    x, y = _regression(16 * N * B)  # 16 updates

    def make(**kw):
        lr = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=8, decay_rate=0.5)
        return keras.optimizers.SGD(lr, **kw)

    out = _three_ways(_mlp, make, x, y, "mse", 1)
    lr = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=8, decay_rate=0.5)
    # The last update is the 16th: the large batch reads step 15; Keras's
    # option reads its micro-step counter, 16 * n - 1.
    out["last_learning_rate"] = {
        "reference": float(lr(15)), "gradaccum": float(lr(15)), "keras": float(lr(16 * N - 1)),
    }
    return out


def ema():
    x, y = _regression(16 * N * B)
    return _three_ways(
        _mlp, lambda **kw: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9, **kw), x, y, "mse", 1
    )


def mirrored():
    x, y = _regression(8 * N * B)
    one = _mlp()
    initial = _weights(one)
    one.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    one.fit(x, y, batch_size=N * B, shuffle=False, verbose=0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {}
    for variant in ("gradaccum", "keras"):
        with strategy.scope():
            model = _mlp()
            opt = (accumulate(keras.optimizers.Adam(0.01), N) if variant == "gradaccum"
                   else keras.optimizers.Adam(0.01, gradient_accumulation_steps=N))
            model.compile(optimizer=opt, loss="mse")
        try:
            model.fit(x, y, batch_size=B, shuffle=False, verbose=0)  # global micro-batch B
        except Exception as error:  # noqa: BLE001 - reported, not handled
            message = str(error)
            cause = "merge_call inside a cond" if "merge_call" in message else message.strip().splitlines()[0][:160]
            out[variant] = {"error": f"{type(error).__name__}: {cause}"}
        else:
            out[variant] = _distance(_weights(model), _weights(one), initial)
    return out


CASES = {"ragged": ragged, "masked": masked, "schedule": schedule, "ema": ema, "mirrored": mirrored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {name: CASES[name]() for name in args.only}
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
