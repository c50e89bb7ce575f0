"""What measuring the gradient noise scale costs per micro-step, in `fit`.

    KERAS_BACKEND=jax python benchmarks/noise_scale.py
    KERAS_BACKEND=torch python benchmarks/noise_scale.py --rounds 5
    python benchmarks/noise_scale.py            # TensorFlow (graph mode)
    python benchmarks/noise_scale.py --jit true # TensorFlow with XLA

Two models compiled alike, `accumulate(Adam, n=4)` with `noise_scale` off and
on (and a second model with it off, whose ratio to the first is the noise of
the measurement), each trained for one epoch of `--steps` micro-steps per
round, in an order rotated from round to round (the first epoch of each, which
traces, is not timed). Prints the median time per micro-step of each and the
median of the per-round ratios on/off, with the range over rounds, and the
ratio of each one's fastest round (the least disturbed by other load), and
the median ratio of the process's CPU time (less disturbed by other
processes on a shared machine than wall time):
ratios in one run on one machine, never absolute times compared across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from gradaccum import accumulate  # noqa: E402

N, B, WIDTH = 4, 64, 512


def _model(noise: bool, jit: bool | str) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((WIDTH,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(10),
    ])
    opt = accumulate(keras.optimizers.Adam(1e-4), N, noise_scale=noise)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=64, help="micro-steps per epoch (a multiple of n)")
    parser.add_argument("--jit", choices=("auto", "true", "false"), default="auto",
                        help="jit_compile (auto: XLA on JAX, none on TensorFlow and PyTorch)")
    parser.add_argument("--threads", type=int, default=0, help="PyTorch's intra-op threads (0: its default)")
    args = parser.parse_args()
    args.jit = {"auto": "auto", "true": True, "false": False}[args.jit]
    if args.threads and keras.config.backend() == "torch":
        import torch

        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * args.steps, WIDTH)).astype("float32")
    y = rng.normal(size=(B * args.steps, 10)).astype("float32")
    # "off (A/A)": a second, identical model without the noise scale, whose
    # ratio to "off" is the noise of the measurement itself.
    models = {"off": _model(False, args.jit), "off (A/A)": _model(False, args.jit), "on": _model(True, args.jit)}
    names = list(models)
    for model in models.values():  # traces, builds
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotated from round to round
            start, start_cpu = time.perf_counter(), time.process_time()
            models[name].fit(x, y, batch_size=B, shuffle=False, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.process_time() - start_cpu) / args.steps)
    print(f"backend={keras.config.backend()} jit_compile={args.jit} n={N} B={B} width={WIDTH} rounds={args.rounds}")
    for name, values in times.items():
        print(f"  noise_scale {name:>9}: {1e3 * statistics.median(values):.3f} ms per micro-step")
    for name in ("on", "off (A/A)"):
        ratios = [a / b for a, b in zip(times[name], times["off"])]
        cpu_ratios = [a / b for a, b in zip(cpu[name], cpu["off"])]
        print(f"  {name} / off: wall, median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
              f"{max(ratios):.3f}), of the fastest rounds {min(times[name]) / min(times['off']):.3f}; "
              f"process CPU time, median {statistics.median(cpu_ratios):.3f} "
              f"(range {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")
    print(f"  noise scale measured: {models['on'].optimizer.noise_scale:.1f}")


if __name__ == "__main__":
    main()
