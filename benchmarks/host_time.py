"""Host time of one micro-step of the optimizer on PyTorch: gradaccum against
Keras's own `gradient_accumulation_steps` and the plain optimizer.

    KERAS_BACKEND=torch python benchmarks/host_time.py            # 200 rounds
    KERAS_BACKEND=torch python benchmarks/host_time.py --rounds 20

Keras's PyTorch trainer runs eagerly, so on a GPU whatever the optimizer does
in Python per micro-step is time the device may wait for. This measures that
Python time alone: the wall time of `optimizer.apply(grads, variables)` on
the CPU build with tiny tensors (the model below has 64 variables of 4 to 16
elements), where the kernels themselves cost next to nothing. Each round
times one cycle of `n` micro-steps of every variant, in an order rotated from
round to round; the table gives each variant's time per micro-step by its
place in the cycle, and the ratio of its whole cycle to the plain
optimizer's and to Keras's option, as medians over rounds with a 95%
bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

N = 4
LAYERS = 32


def _variables() -> list[keras.Variable]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(LAYERS):
        out.append(keras.Variable(rng.normal(size=(4, 4)).astype("float32"), name=f"kernel_{i}"))
        out.append(keras.Variable(np.zeros(4, "float32"), name=f"bias_{i}"))
    return out


def _variants() -> dict[str, tuple[keras.optimizers.Optimizer, list[keras.Variable]]]:
    from gradaccum import accumulate

    make = {
        "plain": lambda: keras.optimizers.Adam(1e-3),
        "gradaccum": lambda: accumulate(keras.optimizers.Adam(1e-3), N),
        "gradaccum, weighted": lambda: accumulate(keras.optimizers.Adam(1e-3), N),
        "keras": lambda: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N),
    }
    out = {}
    for name, factory in make.items():
        variables = _variables()
        optimizer = factory()
        optimizer.build(variables)
        out[name] = (optimizer, variables)
    return out


def _bootstrap(values: list[float], rounds: int = 2000) -> tuple[float, float, float]:
    rng = np.random.default_rng(0)
    data = np.asarray(values)
    medians = [np.median(rng.choice(data, size=len(data))) for _ in range(rounds)]
    return float(np.median(data)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def run(rounds: int) -> None:
    import torch

    variants = _variants()
    names = list(variants)
    grads = [[torch.full(tuple(v.shape), 1e-3 * (k + 1)) for v in _variables()] for k in range(N)]
    weight = torch.tensor(3.0)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds + 5):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            optimizer, variables = variants[name]
            per_step = []
            for k in range(N):
                start = time.perf_counter()
                if name == "gradaccum, weighted":
                    optimizer.apply(grads[k], variables, weight=weight)
                else:
                    optimizer.apply(grads[k], variables)
                per_step.append(time.perf_counter() - start)
            if r >= 5:  # the first rounds warm up
                times[name].append(per_step)
    print(f"torch {torch.__version__}, keras {keras.__version__}; {2 * LAYERS} variables, n={N}, {rounds} rounds")
    print("\nmicroseconds per micro-step, by its place in the cycle (median over rounds):")
    for name in names:
        steps = np.asarray(times[name])
        print(f"  {name:22s} " + "  ".join(f"{1e6 * statistics.median(steps[:, k]):8.1f}" for k in range(N)))
    print("\nwhole cycle, ratio (median over rounds [95% interval]):")
    for base in ("plain", "keras"):
        for name in names:
            if name == base:
                continue
            ratios = [sum(a) / sum(b) for a, b in zip(times[name], times[base])]
            median, low, high = _bootstrap(ratios)
            print(f"  {name:22s} / {base:6s} {median:.3f} [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    run(parser.parse_args().rounds)
