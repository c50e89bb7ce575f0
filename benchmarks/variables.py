"""Time per micro-step and first epoch against the number of variables.

    python benchmarks/variables.py                       # 20, 200 and 800 variables
    python benchmarks/variables.py --variables 20 --rounds 3   # smoke run
    python benchmarks/variables.py --mlp --rounds 5 --steps 8  # the apply step of a 38M-parameter MLP

A stack of `L` `Dense(16)` layers (2L variables, tanh), Adam, n = 4, B = 32,
`model.fit` on TensorFlow without XLA. Compared: gradaccum's default
(`mode="masked"`), `mode="skip"`, and Keras's own
`gradient_accumulation_steps=4`, twice ("keras (A/A)": what the run can
resolve). Each number of variables runs in a process of its own; within
it, every round builds each variant afresh, in an order rotated (and
reversed every other round), and times

- its first epoch: the first `fit` of one cycle, tracing included;
- a micro-step: the median wall time of a micro-step over a second `fit`
  of `--steps` micro-steps (the time between a batch's begin and end
  callbacks, apply steps included);
- an apply step: the median wall time of the micro-steps of that `fit`
  that end a cycle;
- the same two in CPU time of the process (all its threads), which other
  work on a shared machine inflates less than wall time.

`--reuse` builds and traces each variant once (one first epoch each) and
times another `fit` of it every round: many more rounds per minute where
tracing is slow (hundreds of variables).

`--mlp` times instead an MLP of ~37.8M parameters (2048-4096-4096-2048-2048,
B=8, the same n and optimizers), where an apply step's arithmetic weighs
more than its number of variables.

Reported per variant: the median over rounds of its ratio to Keras's option
in the same round, with the smallest and largest ratio. `--json` writes
every round's times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

N, B = 4, 32
WIDTH = 16
VARIANTS = ["keras", "keras (A/A)", "masked", "skip"]


MLP = (2048, 4096, 4096, 2048, 2048)  # ~37.8M parameters
MLP_BATCH = 8


def make_model(layers: int):
    """A stack of `layers` `Dense(16)` layers, or the MLP for `layers=0`."""
    import keras

    keras.utils.set_random_seed(0)
    if layers == 0:
        stack = [keras.Input((MLP[0],))] + [keras.layers.Dense(w, activation="tanh") for w in MLP[1:]]
        return keras.Sequential(stack)
    stack = [keras.Input((WIDTH,))]
    stack += [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(layers)]
    return keras.Sequential(stack)


def make_optimizer(name: str):
    import keras

    from gradaccum import accumulate

    if name.startswith("keras"):
        return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N)
    return accumulate(keras.optimizers.Adam(1e-3), N, mode=name)


def rotated(items: list, r: int) -> list:
    k = r % len(items)
    out = items[k:] + items[:k]
    return out[::-1] if r % 2 else out


def one(variables: int, rounds: int, steps: int, reuse: bool = False) -> dict:
    """Every round's times for `variables` variables (0: the MLP), in this
    process; with `reuse`, each variant is built and traced once."""
    import gc

    import keras
    import numpy as np

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start, self.start_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)
            self.cpu.append(time.process_time() - self.start_cpu)

    batch = MLP_BATCH if variables == 0 else B
    width_in, width_out = (MLP[0], MLP[-1]) if variables == 0 else (WIDTH, WIDTH)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, width_in)).astype("float32")
    y = rng.normal(size=(batch * steps, width_out)).astype("float32")
    # What the process pays once (the first trace of all), paid before timing.
    warm = make_model(1)
    warm.compile(optimizer=make_optimizer("masked"), loss="mse")
    warm.fit(x[: B * N, :WIDTH], y[: B * N, :WIDTH], batch_size=B, shuffle=False, verbose=0)
    measures = ["first_epoch_s", "micro_step_s", "apply_step_s", "micro_step_cpu_s", "apply_step_cpu_s"]
    times: dict = {name: {m: [] for m in measures} for name in VARIANTS}
    models: dict = {}
    for r in range(rounds):
        for name in rotated(VARIANTS, r):
            model = models.get(name)
            if model is None:
                model = make_model(variables // 2)
                model.compile(optimizer=make_optimizer(name), loss="mse")
                start = time.perf_counter()
                model.fit(x[: batch * N], y[: batch * N], batch_size=batch, shuffle=False, verbose=0)
                times[name]["first_epoch_s"].append(time.perf_counter() - start)
                if reuse:
                    models[name] = model
            timer = Timer()
            model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[timer])
            times[name]["micro_step_s"].append(statistics.median(timer.times))
            times[name]["apply_step_s"].append(statistics.median(timer.times[N - 1 :: N]))
            times[name]["micro_step_cpu_s"].append(statistics.median(timer.cpu))
            times[name]["apply_step_cpu_s"].append(statistics.median(timer.cpu[N - 1 :: N]))
            del model
            gc.collect()
    return times


def ratios(times: dict) -> dict:
    """Per variant and measure: median, smallest and largest per-round ratio
    to Keras's option."""
    out: dict = {}
    for name in VARIANTS[1:]:
        out[name] = {}
        for measure, base in times["keras"].items():
            per_round = [a / b for a, b in zip(times[name][measure], base)]
            out[name][measure] = (statistics.median(per_round), min(per_round), max(per_round))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variables", type=int, nargs="+", default=[20, 200, 800])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=24, help="micro-steps timed per round")
    parser.add_argument("--mlp", action="store_true", help="the 38M-parameter MLP instead of the stacks")
    parser.add_argument("--reuse", action="store_true",
                        help="build and trace each variant once; every round times another fit of it")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.rounds, args.steps, args.reuse)))
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="")
    results = {}
    for variables in [0] if args.mlp else args.variables:
        command = [sys.executable, __file__, "--one", str(variables), "--rounds", str(args.rounds),
                   "--steps", str(args.steps)] + (["--reuse"] if args.reuse else [])
        output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        times = json.loads(output.strip().splitlines()[-1])
        results[variables] = times
        what = "MLP of 37.8M parameters" if variables == 0 else f"{variables} variables"
        print(f"{what} ({args.rounds} rounds), ratio to Keras's option: median [min, max]")
        for name, measures in ratios(times).items():
            cells = "  ".join(f"{m} {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]" for m, r in measures.items())
            print(f"  {name:12s} {cells}")
        base = times["keras"]
        print(f"  keras        first epoch {statistics.median(base['first_epoch_s']):.2f} s, "
              f"micro-step {1e3 * statistics.median(base['micro_step_s']):.2f} ms, "
              f"apply step {1e3 * statistics.median(base['apply_step_s']):.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
