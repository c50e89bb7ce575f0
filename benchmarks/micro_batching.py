"""`micro_batch_size="auto"` against hand-chosen sizes and against `n`, on JAX.

    KERAS_BACKEND=jax python benchmarks/micro_batching.py [batches_per_epoch]

An MLP of 256 -> 512 -> 512 -> 10 (Adam), batches of B = 4096 random
samples (activations outweigh the variables), `batches_per_epoch` of them
an epoch (default 32). The memory
limit is half of what XLA's compiled memory analysis gives the plain step
of the whole batch: a device on which the large batch does not fit.

- A sweep over hand-chosen micro-batch sizes: each size's step bytes (XLA's
  analysis) and, for those within the limit, the steady throughput
  (samples per second of a second epoch, the first one compiling).
- `"auto"` with that `memory_limit`: the size it chose, its steady
  throughput against the best hand-chosen size that fits, and the search's
  cost (the seconds its compilations took, and the first epoch's time
  beyond the best hand-chosen size's first epoch: the search's
  compilations) as a share of a steady epoch.
- Today's cross-step `n`: `accumulate(opt, n=k)` on batches of `B / k`, for
  the `k` of the size `"auto"` chose.
- Peak memory: the chosen step's bytes against the plain large batch's.

Goal: "auto" >= 0.95x the best hand-chosen throughput, search <= 2% of an
epoch (the search's seconds are fixed; the share falls with the epoch's
length). On 2 shared CPU cores, throughputs vary by a few percent between
runs.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from gradaccum import _auto_size, accumulate  # noqa: E402
from gradaccum._backend.micro_batches import step_bytes  # noqa: E402

B = 4096


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


class EpochTimes(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.times.append(time.perf_counter() - self.start)


def run(optimizer: keras.optimizers.Optimizer, x: np.ndarray, y: np.ndarray, batch: int) -> tuple[float, float]:
    """`(steady samples per second, first epoch seconds)` of two epochs."""
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    timer = EpochTimes()
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[timer])
    return len(x) / timer.times[1], timer.times[0]


def bytes_of(size: int | None, x: np.ndarray, y: np.ndarray) -> int:
    """XLA's bytes of the train step of one batch of B, split into `size` (None: plain)."""
    model = make_model()
    opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=opt if size is None else accumulate(opt, micro_batch_size=size), loss="mse",
                  jit_compile=True)
    model.fit(x[:B], y[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    return step_bytes(model.train_step, state, (x[:B], y[:B]))


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * B, 256)).astype("float32")
    y = rng.normal(size=(batches * B, 10)).astype("float32")
    plain = bytes_of(None, x, y)
    limit = plain // 2
    print(f"plain step of {B}: {plain / 2**20:.1f} MiB (XLA analysis); memory_limit {limit / 2**20:.1f} MiB")

    sweep, first = {}, {}
    for size in (128, 256, 512, 1024, 1366, 2048):
        need = bytes_of(size, x, y)
        rate = None
        if need <= limit:
            rate, first[size] = run(accumulate(keras.optimizers.Adam(1e-3), micro_batch_size=size), x, y, B)
        sweep[size] = rate
        shown = f"{rate:9.0f} samples/s" if rate else "   does not fit"
        print(f"micro_batch_size={size:4d}: {need / 2**20:6.1f} MiB {shown}")
    best_size = max((s for s in sweep if sweep[s]), key=lambda s: sweep[s])

    measure_seconds = []
    original = _auto_size.Search._measure

    def timed(self: _auto_size.Search, measure, size: int) -> int:
        start = time.perf_counter()
        try:
            return original(self, measure, size)
        finally:
            measure_seconds.append(time.perf_counter() - start)

    _auto_size.Search._measure = timed
    opt = accumulate(keras.optimizers.Adam(1e-3), micro_batch_size="auto", memory_limit=limit)
    auto_rate, auto_first = run(opt, x, y, B)
    _auto_size.Search._measure = original
    chosen = opt.micro_batch_size
    epoch = len(x) / auto_rate
    print(f'"auto": chose {chosen} ({bytes_of(chosen, x, y) / 2**20:.1f} MiB, '
          f"{bytes_of(chosen, x, y) / plain:.2f}x the plain step), {auto_rate:.0f} samples/s = "
          f"{auto_rate / sweep[best_size]:.3f}x the best hand-chosen ({best_size}: {sweep[best_size]:.0f})")
    print(f"search: {len(measure_seconds)} compilations, {sum(measure_seconds):.2f} s = "
          f"{100 * sum(measure_seconds) / epoch:.1f}% of an epoch of {batches} batches ({epoch:.1f} s)")
    # The first epoch's extra time over a steady one, against the best
    # hand-chosen size's (which compiles once): the search.
    extra = (auto_first - epoch) - (first[best_size] - len(x) / sweep[best_size])
    print(f"first epoch: {extra:.2f} s more than the best hand-chosen size's first epoch "
          f"(the search) = {100 * extra / epoch:.1f}% of an epoch")
    k = -(-B // chosen)
    n_rate, _ = run(accumulate(keras.optimizers.Adam(1e-3), n=k), x, y, B // k)
    print(f"n={k} across steps on batches of {B // k}: {n_rate:.0f} samples/s = {n_rate / auto_rate:.3f}x \"auto\"")


if __name__ == "__main__":
    main()
