"""`micro_batch_size="auto"` against hand-chosen sizes and against `n`, on JAX.

    KERAS_BACKEND=jax python benchmarks/micro_batching.py [--rounds R] [--batches K] [--search-only]

An MLP of 256 -> 512 -> 512 -> 10 (Adam, `jit_compile=True`), batches of
B = 4096 random samples (activations outweigh the variables). The memory
limit is half of what XLA's compiled memory analysis gives the plain step of
the whole batch: a device on which the large batch does not fit.

- Peak memory: XLA's compiled memory analysis (`step_bytes`: arguments,
  outputs not aliased to them, temporaries) of the train step of each
  hand-chosen micro-batch size, of the size `"auto"` chose and of `n`
  across steps, against the plain step of the whole batch.
- The search's cost: the seconds (wall and process CPU) of its
  compilations, the median of 3 fresh models, against the steady time of
  an epoch of 61,440 samples (15 batches; about MNIST's 60,000) and, on
  its own, the epoch length at which the search is 2% of it. One such epoch
  is run from scratch with `"auto"`: its first epoch (search and the step's
  own compilation) against its second.
- Steady throughput, interleaved: every hand-chosen size within the limit,
  a second instance of the size `"auto"` chose (the A/A pair: its distance
  from 1.00 is the noise), `"auto"` itself and today's cross-step
  `accumulate(opt, n=k)` on batches of `B / k` (the `k` of the size
  `"auto"` chose). Each is built and compiled once; each round runs every
  variant for `K` batches (default 16: 65,536 samples, about half a second),
  in an order rotated per round (`bench.rotated`), and takes the process
  CPU time (all threads) and the wall time of each. Ratios are per round;
  the report gives their median with a 95% bootstrap interval. On a CPU
  shared with other work the CPU time is the figure to read: the wall time
  counts the waits for a core too.

Goals: "auto" >= 0.95x the best hand-chosen throughput, search <= 2% of an
epoch. `--search-only` times only the search (for comparing versions of it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench import _bootstrap_ci, _median, rotated  # noqa: E402

from gradaccum import _auto_size, accumulate  # noqa: E402
from gradaccum._backend.memory import step_bytes  # noqa: E402

B = 4096
EPOCH = 15 * B  # samples of the realistic epoch
SIZES = (128, 256, 512, 1024, 1366, 2048)


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(1e-3)


def compiled(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    return model


def bytes_of(optimizer: keras.optimizers.Optimizer, batch: int, x: np.ndarray, y: np.ndarray) -> int:
    """XLA's bytes of the train step of one batch of `batch` samples."""
    model = compiled(optimizer)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    return step_bytes(model.train_step, state, (x[:batch], y[:batch]))


class Clock:
    """Wall and process CPU seconds since it was made (`read()`)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class EpochClocks(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[tuple[float, float]] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.clock = Clock()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epochs.append(self.clock.read())


def timed_search(limit: int, x: np.ndarray, y: np.ndarray, epochs: int = 1) -> tuple[list, keras.Model, EpochClocks]:
    """A fresh `"auto"` model fit for `epochs` on `x`: the (wall, CPU)
    seconds of each of the search's compilations, the model, its epochs."""
    seconds = []
    original = _auto_size.Search._measure

    def measure(self: _auto_size.Search, measure, size: int) -> int:
        clock = Clock()
        try:
            return original(self, measure, size)
        finally:
            seconds.append(clock.read())

    _auto_size.Search._measure = measure
    try:
        model = compiled(accumulate(adam(), micro_batch_size="auto", memory_limit=limit))
        clocks = EpochClocks()
        model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, callbacks=[clocks])
    finally:
        _auto_size.Search._measure = original
    return seconds, model, clocks


def search_cost(limit: int, x: np.ndarray, y: np.ndarray) -> tuple[int, int, np.ndarray]:
    """The compilations of the search, the size it chose and their (wall,
    CPU) seconds, the median of 3 fresh models."""
    runs = [timed_search(limit, x[:B], y[:B])[:2] for _ in range(3)]
    seconds = np.median([np.sum(r, axis=0) for r, _ in runs], axis=0)
    return len(runs[0][0]), runs[0][1].optimizer.micro_batch_size, seconds


def interleaved(variants: dict[str, tuple[keras.Model, int]], x: np.ndarray, y: np.ndarray,
                rounds: int) -> dict[str, np.ndarray]:
    """Per variant, the (wall, CPU) seconds of each round (rows)."""
    names = list(variants)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            model, batch = variants[name]
            clock = Clock()
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            times[name].append(clock.read())
    return {name: np.array(t) for name, t in times.items()}


def ratio(times: dict[str, np.ndarray], a: str, b: str, column: int) -> str:
    """Throughput of `a` over `b` (time of `b` over `a`) per round: median [95% interval]."""
    per_round = times[b][:, column] / times[a][:, column]
    low, high = _bootstrap_ci([per_round], _median)
    return f"{np.median(per_round):.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=16, help="batches of B per variant and round")
    parser.add_argument("--search-only", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    samples = max(EPOCH, args.batches * B)
    x = rng.normal(size=(samples, 256)).astype("float32")
    y = rng.normal(size=(samples, 10)).astype("float32")
    plain = bytes_of(adam(), B, x, y)
    limit = plain // 2
    print(f"plain step of {B}: {plain / 2**20:.1f} MiB (XLA analysis); memory_limit {limit / 2**20:.1f} MiB")

    count, size, (search_wall, search_cpu) = search_cost(limit, x, y)
    print(f"search: {count} compilations choosing {size}, {search_wall:.2f} s wall, {search_cpu:.2f} s CPU "
          "(median of 3 models)")
    if args.search_only:
        return

    # One realistic epoch from scratch: the first holds the search and the
    # step's compilation, the second is steady.
    _, model, clocks = timed_search(limit, x[:EPOCH], y[:EPOCH], epochs=2)
    chosen = model.optimizer.micro_batch_size
    (first_wall, first_cpu), (epoch_wall, epoch_cpu) = clocks.epochs
    print(f'"auto" chose {chosen}. An epoch of {EPOCH} samples: first {first_wall:.2f} s wall / '
          f"{first_cpu:.2f} s CPU, steady {epoch_wall:.2f} s wall / {epoch_cpu:.2f} s CPU; the search is "
          f"{100 * search_wall / epoch_wall:.0f}% (wall) / {100 * search_cpu / epoch_cpu:.0f}% (CPU) "
          "of the steady epoch")
    two_percent = 50 * search_cpu * EPOCH / epoch_cpu
    print(f"the search is 2% of a steady epoch of {50 * search_cpu:.0f} s CPU: {two_percent:,.0f} samples "
          f"({two_percent / B:,.0f} batches of {B})")

    k = -(-B // chosen)
    print("peak memory (XLA analysis of the train step) / plain step of the whole batch:")
    fitting = []
    for size in SIZES:
        need = bytes_of(accumulate(adam(), micro_batch_size=size), B, x, y)
        fits = need <= limit
        fitting += [size] if fits else []
        print(f"  micro_batch_size={size:4d}: {need / 2**20:5.1f} MiB {need / plain:.2f}x"
              f"{'' if fits else '  (over the limit)'}")
    need = bytes_of(accumulate(adam(), micro_batch_size=chosen), B, x, y)
    print(f'  "auto" ({chosen}): {need / 2**20:5.1f} MiB {need / plain:.2f}x')
    need = bytes_of(accumulate(adam(), n=k), B // k, x, y)
    print(f"  n={k} on batches of {B // k}: {need / 2**20:5.1f} MiB {need / plain:.2f}x")

    variants = {f"m={size}": (compiled(accumulate(adam(), micro_batch_size=size)), B) for size in fitting}
    variants[f"m={chosen} again"] = (compiled(accumulate(adam(), micro_batch_size=chosen)), B)
    variants["auto"] = (compiled(accumulate(adam(), micro_batch_size="auto", memory_limit=limit)), B)
    variants[f"n={k}"] = (compiled(accumulate(adam(), n=k)), B // k)
    data = (x[: args.batches * B], y[: args.batches * B])
    interleaved(variants, *data, rounds=1)  # compiles each
    times = interleaved(variants, *data, rounds=args.rounds)
    print(f"steady throughput: {args.rounds} rounds of {args.batches * B} samples a variant, rotated; "
          "median [95% interval] of the per-round ratios")
    for name, t in times.items():
        cpu, wall = np.median(t[:, 1]), np.median(t[:, 0])
        print(f"  {name:16s} {args.batches * B / cpu:8.0f} samples/s CPU, {args.batches * B / wall:8.0f} wall")
    best = max((f"m={size}" for size in fitting), key=lambda name: -np.median(times[name][:, 1]))
    for a, b, what in ((f"m={chosen} again", f"m={chosen}", "A/A"), ("auto", best, "the best hand-chosen"),
                       ("auto", f"m={chosen}", "the same size by hand"),
                       (f"n={k}", "auto", '"auto"')):
        print(f"  {a} / {b} ({what}): CPU {ratio(times, a, b, 1)}, wall {ratio(times, a, b, 0)}")


if __name__ == "__main__":
    main()
