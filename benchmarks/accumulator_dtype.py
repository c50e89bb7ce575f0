"""Memory and error of `accumulator_dtype="bfloat16"` against float32, n=32.

    python benchmarks/accumulator_dtype.py          # TensorFlow

A bfloat16 model (Keras's `"bfloat16"` dtype policy: bfloat16 variables and
gradients), an MLP of 64 -> 1024 -> 1024 -> 10, 32 micro-batches of 32
random samples. Each accumulating optimizer (n=33, so that nothing is
applied) adds the same 32 bfloat16 micro-gradients; the sum it holds
(float32: the accumulator; bfloat16: accumulator minus compensation) is
compared with the exact sum (float64) of the same micro-gradients, as the
relative error |held - exact| / |exact| over the elements where the exact
sum is not 0 (large where the micro-gradients cancel), as the largest
error over the root mean square of the exact sum, and as the relative
error of the whole sum's norm. A plain
bfloat16 sum (rounded at every addition, computed with NumPy) shows what
the compensation keeps. Memory: the bytes of the accumulation state's
per-variable buffers.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradaccum import accumulate  # noqa: E402

N, B = 32, 32


def main() -> None:
    keras.config.set_dtype_policy("bfloat16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])
    rng = np.random.default_rng(0)
    grads = []
    for _ in range(N):
        x = rng.normal(size=(B, 64)).astype("float32")
        y = rng.normal(size=(B, 10)).astype("float32")
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        grads.append(tape.gradient(loss, model.trainable_variables))
    as64 = [[np.asarray(tf.cast(g, tf.float64)) for g in step] for step in grads]
    exact = [np.sum([step[i] for step in as64], axis=0) for i in range(len(as64[0]))]

    plain = [np.zeros_like(np.asarray(g)) for g in grads[0]]  # bfloat16 NumPy arrays
    for step in grads:
        plain = [(p.astype(np.float32) + np.asarray(g).astype(np.float32)).astype(p.dtype) for p, g in zip(plain, step)]
    held = {"bfloat16, plain (no compensation)": [p.astype(np.float64) for p in plain]}
    memory = {}
    for dtype in ("float32", "bfloat16"):
        opt = accumulate(keras.optimizers.SGD(0.1), N + 1, accumulator_dtype=dtype)
        opt.build(model.trainable_variables)
        for step in grads:
            opt.apply(step, model.trainable_variables)
        state = opt._self_core.state
        buffers = list(state.accumulators) + list(state.compensations or [])
        memory[dtype] = sum(int(np.prod(a.shape)) * a.dtype.size for a in buffers)
        sums = [np.asarray(tf.cast(a, tf.float64)) for a in state.accumulators]
        if state.compensations is not None:
            sums = [s - np.asarray(tf.cast(c, tf.float64)) for s, c in zip(sums, state.compensations)]
        held[f"{dtype} accumulators" + (" (compensated)" if dtype == "bfloat16" else "")] = sums

    exact_flat = np.concatenate([e.ravel() for e in exact])
    nonzero = exact_flat != 0
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"bfloat16 MLP, {parameters} parameters, n={N} micro-batches of {B}")
    rms = np.sqrt(np.mean(exact_flat**2))
    print(f"{'accumulation':38} {'median rel. err':>16} {'max rel. err':>14} {'max err / rms':>14} "
          f"{'norm rel. err':>14}")
    for name, sums in held.items():
        flat = np.concatenate([s.ravel() for s in sums])
        rel = np.abs(flat - exact_flat)[nonzero] / np.abs(exact_flat)[nonzero]
        norm = abs(np.linalg.norm(flat) - np.linalg.norm(exact_flat)) / np.linalg.norm(exact_flat)
        worst = np.max(np.abs(flat - exact_flat)) / rms
        print(f"{name:38} {np.median(rel):16.2e} {np.max(rel):14.2e} {worst:14.2e} {norm:14.2e}")
    for dtype, size in memory.items():
        print(f"state buffers, accumulator_dtype={dtype!r}: {size / 2**20:.2f} MiB ({size / parameters:.0f} bytes per parameter)")


if __name__ == "__main__":
    main()
