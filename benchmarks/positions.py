"""Time of each micro-step of a cycle, gradaccum against Keras's built-in option.

    python benchmarks/positions.py                 # skip mode, MLP, Adam, B=8, n=4
    python benchmarks/positions.py --mode masked --against plain

`bench.py` times whole `fit` calls; this finds where in a cycle a difference
is. Every variant (one model and optimizer each, same initial weights) runs
a traced step of its own on one fixed micro-batch: forward and backward
pass, then `apply_gradients`. Cycles of all variants alternate, in an order
rotated from cycle to cycle, and every call is timed alone (process CPU
time). The table gives, for each position in the cycle (the last is the
apply step), the median time of the reference and each variant's median
over the reference's; "(A/A)" is a second copy of a variant, for the noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import bench  # noqa: E402


def make_step(model_kind: str, make_optimizer, x, y):
    import tensorflow as tf

    model = bench.make_model(model_kind)
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["skip", "masked"], default="skip")
    parser.add_argument("--against", choices=["keras", "plain"], default="keras",
                        help="reference: Keras's gradient_accumulation_steps or the plain optimizer")
    parser.add_argument("--model", choices=["mlp", "conv"], default="mlp")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=bench.N)
    parser.add_argument("--cycles", type=int, default=60)
    args = parser.parse_args(argv)
    for name in ("batch", "n", "cycles"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")

    import tensorflow as tf

    from gradaccum import accumulate

    n, opt = args.n, args.optimizer
    if args.against == "keras" and n < 2:
        parser.error("--n must be at least 2 against Keras's option")
    x, y = (tf.constant(a) for a in bench.make_data(args.model, args.batch))
    reference = {
        "keras": lambda: bench.make_optimizer(opt, gradient_accumulation_steps=n),
        "plain": lambda: bench.make_optimizer(opt),
    }[args.against]
    ours = lambda: accumulate(bench.make_optimizer(opt), n, mode=args.mode)  # noqa: E731
    made = {
        args.against: reference,
        args.mode: ours,
        f"{args.against} (A/A)": reference,
        f"{args.mode} (A/A)": ours,
    }
    steps = {name: make_step(args.model, make, x, y) for name, make in made.items()}
    for step in steps.values():  # trace, and two cycles of warm-up
        for _ in range(2 * n):
            step()
    names = list(steps)
    cpu = {(name, p): [] for name in names for p in range(n)}
    for c in range(args.cycles):
        for name in bench.rotated(names, c):
            for p in range(n):
                t0 = time.process_time()
                steps[name]()
                cpu[name, p].append(time.process_time() - t0)

    print(f"{args.model}, {opt}, B={args.batch}, n={n}, {args.cycles} cycles; "
          f"ratio of median CPU time per call to {args.against}'s")
    print("| micro-step | " + f"{args.against}, ms | " + " | ".join(names[1:]) + " |")
    print("|---" * (len(names) + 1) + "|")
    totals = {name: np.sum([cpu[name, p] for p in range(n)], axis=0) for name in names}
    for p in range(n):
        base = np.median(cpu[names[0], p])
        label = f"{p + 1}" + (" (apply)" if p == n - 1 else "")
        cells = [f"{np.median(cpu[name, p]) / base:.3f}" for name in names[1:]]
        print(f"| {label} | {1000 * base:.2f} | " + " | ".join(cells) + " |")
    whole = [f"{np.median(totals[name] / totals[names[0]]):.3f}" for name in names[1:]]
    print(f"| whole cycle | {1000 * np.median(totals[names[0]]):.2f} | " + " | ".join(whole) + " |")


if __name__ == "__main__":
    main()
