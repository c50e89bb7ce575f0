"""JAX: an in-between micro-step of `accumulate(Adam, n=4)` against a plain Adam step.

    KERAS_BACKEND=jax python benchmarks/jax_micro_step.py                  # both models
    KERAS_BACKEND=jax python benchmarks/jax_micro_step.py --models mlp --rounds 5   # smoke run

What `model.fit` runs of the optimizer on a micro-step, alone:
`optimizer.stateless_apply` under `jax.jit`, the optimizer state and the
model's variables donated (as Keras's JAX trainer donates them), with a
float32 weight per micro-step (as `fit` hands over its loss count). The
accumulating optimizer is held on a micro-step that does not end its
cycle: its micro-step counter is set to 1 before every call, so every call
is the cycle's second micro-step of four. Gradients are fixed random
arrays, the same for every variant.

Models: "mlp", the shapes of `bench.py`'s MLP (1024-2048-1024-10, ~4.2M
parameters, 6 variables), where the arithmetic per element dominates; "stack", a stack
of 100 `Dense(16)` layers (200 variables, as `variables.py`), where the
cost per variable does.

Variants: "plain" (Adam), "plain (A/A)" (a second, identical Adam: its
ratio is what a round can resolve), "in-between" (the accumulating
optimizer) and "floor": plain JAX, no Keras, taking the same state as the
accumulating optimizer (the model's variables, Adam's, one accumulator
per variable), adding the gradients into the accumulators and handing
everything else back unchanged: what any in-between step that keeps its
sums in jitted state costs at least; "flat", the same with one flat
accumulator for all variables (the gradients concatenated and added in
one), and "flat, small", with one flat accumulator for the variables of at
most `SMALL` elements and one per variable for the others. Every round runs `--calls` calls of each variant, in an order
rotated (and reversed every other round), and takes the median wall time
and the median CPU time of the process (all threads) of a call, each
waited for with `block_until_ready`. Reported: the median over rounds of
each variant's ratio to "plain" in the same round, with the smallest and
largest ratio, the in-between step's ratio to the mean of "plain" and
"plain (A/A)" in the same round (the two copies differ by a few percent
in every run), and plain's median times per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

N = 4
VARIANTS = ["plain", "plain (A/A)", "in-between", "floor", "flat", "flat, small"]
# "flat, small" packs only the variables of at most this many elements.
SMALL = 1 << 14


def make_model(kind: str):
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        sizes, inputs = [2048, 1024, 10], 1024
    else:
        sizes, inputs = [16] * 100, 16
    return keras.Sequential([keras.Input((inputs,))] + [keras.layers.Dense(s, activation="relu") for s in sizes])


def runner(kind: str, variant: str):
    """A function running one jitted call of `variant`'s optimizer step."""
    import jax
    import keras
    import numpy as np

    from gradaccum import accumulate

    model = make_model(kind)
    variables = model.trainable_variables
    if variant == "floor" or variant.startswith("flat"):
        return _floor(variables, variant)
    opt = keras.optimizers.Adam(1e-3)
    if variant == "in-between":
        opt = accumulate(opt, N)
    opt.build(variables)
    rng = np.random.default_rng(0)
    grads = [jax.numpy.asarray(rng.normal(size=v.shape).astype("float32") * 1e-3) for v in variables]
    weight = jax.numpy.float32(32.0)
    names = [v.path for v in opt.variables]
    counter = next((i for i, name in enumerate(names) if name.endswith("gradaccum_micro_step")), None)

    weighted = variant == "in-between"
    # The state goes in and comes out in one order, as in Keras's JAX train
    # step: donated buffers are matched to outputs in order of shape.
    fn = jax.jit(
        lambda t, o, g, w: opt.stateless_apply(o, g, t, weight=w) if weighted else opt.stateless_apply(o, g, t),
        donate_argnums=(0, 1),
    )
    state = {"opt": [v.value for v in opt.variables], "train": [v.value for v in variables]}

    def call() -> None:
        opt_values = state["opt"]
        if counter is not None:
            opt_values = list(opt_values)
            opt_values[counter] = jax.numpy.int32(1)  # the cycle's second micro-step of N
        train, opt_values = fn(state["train"], opt_values, grads, weight)
        state["opt"], state["train"] = opt_values, train
        jax.block_until_ready(train)

    for _ in range(3):
        call()
    return call


def _floor(variables, variant: str):
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    grads = [jax.numpy.asarray(rng.normal(size=v.shape).astype("float32") * 1e-3) for v in variables]

    def step(state, grads):
        model, moments, sums = state
        if variant == "floor":
            return model, moments, [s + g for s, g in zip(sums, grads)]
        packed = [g.ravel() for g in grads if variant == "flat" or g.size <= SMALL]
        others = [g for g in grads if variant != "flat" and g.size > SMALL]
        added = [sums[0] + jax.numpy.concatenate(packed)] if packed else []
        return model, moments, added + [s + g for s, g in zip(sums[len(added):], others)]

    fn = jax.jit(step, donate_argnums=0)

    def zeros(copies: int) -> list:
        return [jax.numpy.zeros(v.shape, "float32") for _ in range(copies) for v in variables]

    sums = zeros(1)
    if variant != "floor":  # one flat accumulator (all float32 here), and one per variable left out
        packed = [v for v in variables if variant == "flat" or int(np.prod(v.shape)) <= SMALL]
        others = [jax.numpy.zeros(v.shape, "float32") for v in variables if not any(v is p for p in packed)]
        sums = [jax.numpy.zeros(sum(int(np.prod(v.shape)) for v in packed), "float32")] + others
    state = {"state": ([v.value for v in variables], zeros(2), sums)}

    def call() -> None:
        state["state"] = fn(state["state"], grads)
        jax.block_until_ready(state["state"])

    for _ in range(3):
        call()
    return call


def rotated(items: list, r: int) -> list:
    k = r % len(items)
    out = items[k:] + items[:k]
    return out[::-1] if r % 2 else out


def measure(kind: str, rounds: int, calls: int) -> dict:
    runners = {name: runner(kind, name) for name in VARIANTS}
    times: dict = {clock: {name: [] for name in VARIANTS} for clock in ("wall", "cpu")}
    for r in range(rounds):
        for name in rotated(VARIANTS, r):
            call, wall, cpu = runners[name], [], []
            for _ in range(calls):
                start, start_cpu = time.perf_counter(), time.process_time()
                call()
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            times["wall"][name].append(statistics.median(wall))
            times["cpu"][name].append(statistics.median(cpu))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "stack"], choices=["mlp", "stack"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    for kind in args.models:
        times = measure(kind, args.rounds, args.calls)
        print(f"{kind} ({args.rounds} rounds of {args.calls} calls), ratio to plain Adam: median [min, max]")
        for name in VARIANTS[1:]:
            cells = []
            for clock, by_name in times.items():
                per_round = [a / b for a, b in zip(by_name[name], by_name["plain"])]
                cells.append(f"{clock} {statistics.median(per_round):.3f} [{min(per_round):.3f}, {max(per_round):.3f}]")
            print(f"  {name:12s} " + "  ".join(cells))
        # The A/A copy reads a few percent off plain in every run: the
        # in-between step against the mean of the two, so that neither copy's place
        # decides a ratio near 1.
        cells = []
        for clock, by_name in times.items():
            both = [(a + b) / 2 for a, b in zip(by_name["plain"], by_name["plain (A/A)"])]
            per_round = [a / b for a, b in zip(by_name["in-between"], both)]
            cells.append(f"{clock} {statistics.median(per_round):.3f} [{min(per_round):.3f}, {max(per_round):.3f}]")
        print("  in-between / mean of plain and its A/A copy: " + "  ".join(cells))
        print("  plain        " + "  ".join(
            f"{clock} {1e3 * statistics.median(by_name['plain']):.3f} ms" for clock, by_name in times.items()
        ) + " per call", flush=True)


if __name__ == "__main__":
    main()
