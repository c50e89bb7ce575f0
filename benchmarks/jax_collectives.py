"""What a cycle communicates under `keras.distribution.DataParallel` on JAX, and
what a micro-step costs, against plain training and Keras's own accumulation.

    python benchmarks/jax_collectives.py                  # ~2 minutes
    python benchmarks/jax_collectives.py --rounds 3 --json out.json

Runs on two JAX host devices (it sets
`XLA_FLAGS=--xla_force_host_platform_device_count=2` before JAX starts).
The model is the benchmarks' MLP (1024-2048-1024-10, 4.2M float32
parameters, 16.8 MB of gradients), Adam, a global micro-batch of `B` = 16
(8 per device), `n` = 4. Variants, each compiled as `fit` compiles its
train step:

- `plain`: the plain optimizer at `B`, one update per micro-step;
- `keras`: Keras's `gradient_accumulation_steps=n`;
- `gradaccum_masked`, `gradaccum_skip`: `accumulate(Adam, n, mode=...)`.

Communication is read from the optimized HLO of the train step: every
`all-reduce` and its bytes, split into those outside any conditional branch
(run on every micro-step) and those inside one (here: the apply branch, run
once per cycle). Bytes per cycle = `n` x outside + inside. Time: the compiled
step run `n * cycles` times (whole cycles), wall time per micro-step; rounds
rotate the variants' order, and the table gives the median over rounds and
its ratio to `plain`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from gradaccum import accumulate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.helpers.hlo import all_reduces  # noqa: E402

N = 4
B = 16
VARIANTS = ("plain", "keras", "gradaccum_masked", "gradaccum_skip")


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])


def make_optimizer(variant: str):
    if variant == "plain":
        return keras.optimizers.Adam(1e-3)
    if variant == "keras":
        return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N)
    return accumulate(keras.optimizers.Adam(1e-3), N, mode=variant.rsplit("_", 1)[1])


class Run:
    """One variant's model, compiled step and state, under the distribution."""

    def __init__(self, variant: str, distribution, x: np.ndarray, y: np.ndarray):
        from keras.src.backend.jax.trainer import _distribute_data

        with distribution.scope():
            self.model = make_model()
            self.model.compile(optimizer=make_optimizer(variant), loss="sparse_categorical_crossentropy")
            # Builds everything (and installs gradaccum's train step) as fit would.
            self.model.fit(x[:B * N], y[:B * N], batch_size=B, shuffle=False, verbose=0)
            self.batches = [_distribute_data((x[i:i + B], y[i:i + B])) for i in range(0, len(x), B)]
        model = self.model
        self.state = tuple(
            [v.value for v in variables]
            for variables in (model.trainable_variables, model.non_trainable_variables,
                              model.optimizer.variables, model.metrics_variables)
        )
        self.step = jax.jit(model.train_step, donate_argnums=0)
        self.hlo = self.step.lower(self.state, self.batches[0]).compile().as_text()

    def time_per_micro_step(self) -> float:
        state = self.state
        logs, state = self.step(state, self.batches[0])  # warm
        jax.block_until_ready(state)
        start = time.perf_counter()
        for data in self.batches:
            logs, state = self.step(state, data)
        jax.block_until_ready(state)
        self.state = state
        return (time.perf_counter() - start) / len(self.batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=8, help="cycles per timed run")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    devices = jax.devices()
    assert len(devices) >= 2, devices
    distribution = keras.distribution.DataParallel(devices=devices[:2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * N * args.cycles, 1024)).astype("float32")
    y = rng.integers(0, 10, size=(B * N * args.cycles,)).astype("int32")
    runs = {v: Run(v, distribution, x, y) for v in VARIANTS}
    parameters = sum(int(np.prod(v.shape)) for v in runs["plain"].model.trainable_variables)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            times[v].append(runs[v].time_per_micro_step())

    figures = {}
    plain_cycle = None
    for v in VARIANTS:
        reduces = {k: [a.bytes for a in found] for k, found in all_reduces(runs[v].hlo).items()}
        per_cycle = N * sum(reduces["outside"]) + sum(reduces["inside"])
        plain_cycle = plain_cycle or per_cycle
        figures[v] = {
            "all_reduce_bytes_every_micro_step": reduces["outside"],
            "all_reduce_bytes_in_branches": reduces["inside"],
            "bytes_per_cycle": per_cycle,
            "bytes_per_cycle_ratio": per_cycle / plain_cycle,
            "ms_per_micro_step": 1e3 * statistics.median(times[v]),
            "ms_per_micro_step_ratio": statistics.median(times[v]) / statistics.median(times["plain"]),
        }
    print(f"DataParallel over 2 host devices; MLP with {parameters:,} parameters "
          f"({4 * parameters / 1e6:.1f} MB of float32 gradients); B={B} (global), n={N}; "
          f"{args.rounds} rounds of {args.cycles} cycles")
    print(f"{'variant':18} {'MB/cycle':>9} {'ratio':>6} {'ms/micro-step':>14} {'ratio':>6}  "
          "all-reduces every step / in branches (bytes)")
    for v, f in figures.items():
        print(f"{v:18} {f['bytes_per_cycle'] / 1e6:9.2f} {f['bytes_per_cycle_ratio']:6.2f} "
              f"{f['ms_per_micro_step']:14.2f} {f['ms_per_micro_step_ratio']:6.2f}  "
              f"{f['all_reduce_bytes_every_micro_step']} / {f['all_reduce_bytes_in_branches']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"parameters": parameters, "B": B, "n": N, "rounds": args.rounds,
                       "cycles": args.cycles, "variants": figures}, out, indent=2)


if __name__ == "__main__":
    main()
