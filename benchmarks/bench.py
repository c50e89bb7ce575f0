"""Speed and memory of `accumulate()` against the plain optimizer and Keras's
built-in `gradient_accumulation_steps`, with each target and pass/fail.

    python benchmarks/bench.py            # full run (30 to 60 minutes on 2 cores)
    python benchmarks/bench.py --quick    # smoke run (a few minutes)
    python benchmarks/bench.py --only time memory growth tracing
    python benchmarks/bench.py --only time --cases conv   # some timing cases
    python benchmarks/bench.py --only time --cases conv/adam/B=64/graph --rounds 300

Method
------
Time: every variant of a case lives in one process, each with its own model
(same architecture and initial weights) and optimizer, compiled and warmed up
(traced) first. Each variant exists twice, the copies created in order and
then in reverse order: identical variants were measured up to 4% apart
depending on when they were created, and the two copies cancel that. Each
round runs one `model.fit` of one cycle (n micro-steps) for every copy, in
an order rotated from round to round, so the variants take turns every few
tenths of a second. A callback takes the process CPU time (all threads) of
each call of the train function; per round, each variant's train-step time
(the mean of its copies) is divided by the plain optimizer's, and the table
gives the median of these per-round ratios with a 95% bootstrap interval
over rounds. Drift and load from other processes that last longer than a
round cancel; CPU time is steadier than wall time under such load. The wall
time of each whole `fit` is reported beside it, and each train step's CPU
time by its position in the cycle (median over rounds and copies), which
shows whether a difference is on the step that ends a cycle or on every
micro-step. "plain B (A/A)" is a
second, identical plain optimizer: its ratio shows the noise. Every variant
trains on the same samples per `fit`, so a ratio is a ratio of time per
micro-batch of B samples (for "plain B*n", per B samples of its B*n
batches).

A target on time or memory passes only if its whole 95% interval (over
rounds, or over processes) is within the goal, fails if all of it is
beyond, and is "within noise" otherwise.

Memory: every variant runs in fresh processes (9 each under each of two CPU
allocators, the variants taking turns) on a model of about 25M parameters;
each figure is the median over its processes. Under TensorFlow's default
allocator two peaks are measured over the micro-steps after warm-up: that
of TensorFlow's allocator (the live tensors, counted in the blocks it
handed out) and the peak resident set size (reset by
`/proc/self/clear_refs`). With oneDNN that allocator is a pool that keeps
the memory of freed tensors resident (256 MiB of freed tensors stay
resident, with or without `MALLOC_MMAP_THRESHOLD_`), so that resident peak
is the highest the pool reached at any time, warm-up included, and varies
between identical processes with the order in which the executor ran
independent operations. Under the system allocator
(`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1`, `malloc` handing large blocks back at
once) freed tensors leave the resident set, so the peak resident set size
over the measured micro-steps is what the variant holds while it trains.
"extra" is a variant's peak minus the plain optimizer's peak, in multiples
of the parameter bytes. All this holds where oneDNN is on (TensorFlow turns
it on by default only on CPUs with AVX-512; `TF_ENABLE_ONEDNN_OPTS=1` turns
it on elsewhere). Without it the default allocator is `malloc` as well and
keeps no statistics: both columns of resident peaks then measure the same
thing, and the allocator's columns read "n/a". The report says which.

Growth: 5,000 micro-steps of `fit` in a fresh process, resident set size
sampled every 250 steps.

Tracing: how often `fit` runs the proxy's Python code (once per trace of the
train function), for several `n`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

N = 4  # micro-batches per update in every case
COPIES = 2  # instances of each variant in a timing case (see time_case)
TARGETS = {
    "masked_vs_plain_mlp_adam": 1.15,
    "masked_vs_plain_conv": 1.03,
    "skip_vs_keras_mlp_adam": 1.05,
    "masked_extra_memory": 1.5,
    "masked_vs_plain_mlp_sgd_graph": 1.15,
    "masked_vs_plain_mlp_sgd_jit": 1.30,
    # Skip mode against Keras's option in every case: the median at most
    # 1.00 and the interval's upper end at most 1.02.
    "skip_vs_keras": (1.00, 1.02),
}


# ----------------------------------------------------------------------
# Models, optimizers and variants.


def _tf():
    import keras
    import tensorflow as tf

    return tf, keras


def make_model(kind: str, seed: int = 0):
    _, keras = _tf()
    keras.utils.set_random_seed(seed)
    if kind == "mlp":  # ~4.2M parameters: optimizer-heavy at B=8
        layers = [
            keras.Input((1024,)),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    elif kind == "conv":  # ~57K parameters: compute-heavy at B=64
        layers = [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    elif kind == "big":  # ~25.2M parameters: for memory
        layers = [
            keras.Input((1024,)),
            keras.layers.Dense(4096, activation="relu"),
            keras.layers.Dense(4096, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    elif kind == "small":  # ~85K parameters: quick steps, a short micro-step
        layers = [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        raise ValueError(kind)
    return keras.Sequential(layers, name=kind)


def make_data(kind: str, samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = {"mlp": (1024,), "big": (1024,), "small": (64,), "conv": (32, 32, 3)}[kind]
    x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.normal(size=(samples, 10)).astype("float32")
    return x, y


def make_optimizer(name: str, **kwargs):
    _, keras = _tf()
    if name == "adam":
        return keras.optimizers.Adam(1e-4, **kwargs)
    if name == "sgd":
        return keras.optimizers.SGD(1e-3, **kwargs)
    raise ValueError(name)


def adds_only():
    """The floor of any accumulation: an optimizer whose update only adds
    each gradient into an accumulator of its own (in place), and never
    applies anything. What a micro-step costs beyond it is the cost of
    keeping the real update (masked mode) or of deciding to skip it."""
    _, keras = _tf()

    class AddsOnly(keras.optimizers.Optimizer):
        def build(self, variables):
            super().build(variables)
            self._sums = self.add_optimizer_variables(variables, "sum")

        def update_step(self, gradient, variable, learning_rate):
            self.assign_add(self._sums[self._get_variable_index(variable)], gradient)

    return AddsOnly(learning_rate=0.0)


# name -> (how to make the optimizer, batch size as a multiple of B)
def variants(opt_name: str) -> dict[str, tuple[Callable[[], Any], int]]:
    from gradaccum import accumulate

    made = {
        "plain B": (lambda: make_optimizer(opt_name), 1),
        "plain B (A/A)": (lambda: make_optimizer(opt_name), 1),
        "masked": (lambda: accumulate(make_optimizer(opt_name), N), 1),
        "skip": (lambda: accumulate(make_optimizer(opt_name), N, mode="skip"), 1),
        "keras": (lambda: make_optimizer(opt_name, gradient_accumulation_steps=N), 1),
        "plain B*n": (lambda: make_optimizer(opt_name), N),
    }
    if opt_name == "sgd":
        # Where the update is cheap, the floor explains the masked mode's cost.
        made["floor: adds only"] = (adds_only, 1)
    return made


# ----------------------------------------------------------------------
# Time.


def rotated(items: list, r: int) -> list:
    """The order of round `r`: `items` rotated by `r`, reversed in odd rounds,
    so that no variant keeps its place next to the same neighbours."""
    order = items[r % len(items):] + items[: r % len(items)]
    return order[::-1] if r % 2 else order


def _step_timer():
    """A Keras callback recording the process CPU time of every train step
    (`.seconds`, in order; one step is one call of the train function).
    Keras only: `backends.py` uses it without TensorFlow."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.process_time() - self._start)

    return StepTimer()


def time_variants(made: dict[str, tuple[Callable[[], Any], int]],
                  fit_for: Callable[[Callable[[], Any], int], Callable[[list], None]],
                  micro_steps: int, rounds: int, log, copies: int = COPIES) -> dict:
    """The timing loop of the module docstring, for any backend.

    Args:
        made: Variant name -> (how to make its optimizer, its batch size as
            a multiple of B), as `variants` gives; "plain B" is the reference.
        fit_for: Called with one variant's pair; builds, compiles and warms
            up (traces) a model with that optimizer and returns a function
            that runs one `fit` of one cycle with the given callbacks.
        micro_steps: Micro-steps per cycle (n).
        rounds: Timing rounds.
        log: `print`-like progress output.
        copies: Instances of each variant.

    Returns:
        Per variant: the median per-round ratio to "plain B" of train-step
        CPU time with its 95% interval, that of the wall time of the `fit`,
        milliseconds per micro-step, and each train step's CPU milliseconds
        by its position in the cycle; under "_rounds", the per-round times.
    """
    names = list(made)
    # Each variant twice, created in order and then in reverse: identical
    # variants measured up to 4% apart depending on when they were created
    # (where their buffers landed), and a variant's two copies cancel a
    # trend over creation order.
    creation = [(name, c) for c in range(copies)
                for name in (names if c % 2 == 0 else names[::-1])]
    runs = {key: (fit_for(*made[key[0]]), _step_timer()) for key in creation}
    # Per round, per variant (mean of its copies): CPU seconds of the train
    # steps of one `fit`, and CPU and wall seconds of the whole `fit`.
    steps_cpu = {k: [] for k in names}
    cpu = {k: [] for k in names}
    wall = {k: [] for k in names}
    # CPU seconds of each train step of the round's `fit`, by its position
    # in the cycle (the last ends it), over rounds and copies: where in a
    # cycle a difference is, in `fit` as it runs.
    by_position = {k: [[] for _ in range(micro_steps // made[k][1])] for k in names}
    for r in range(rounds):
        spent = {k: [0.0, 0.0, 0.0] for k in names}
        for key in rotated(creation, r):
            fit, timer = runs[key]
            c0, w0 = time.process_time(), time.perf_counter()
            fit([timer])
            spent[key[0]][1] += time.process_time() - c0
            spent[key[0]][2] += time.perf_counter() - w0
            steps = timer.seconds[-len(by_position[key[0]]):]
            spent[key[0]][0] += sum(steps)
            for position, seconds in zip(by_position[key[0]], steps):
                position.append(seconds)
        for k in names:
            steps_cpu[k].append(spent[k][0] / copies)
            cpu[k].append(spent[k][1] / copies)
            wall[k].append(spent[k][2] / copies)
        if r % 10 == 9:
            log(".", end="")
    log("")
    out: dict[str, Any] = {"_rounds": {"steps_cpu_s": steps_cpu, "cpu_s": cpu, "wall_s": wall}}
    for name in names:
        rc = _round_ratios(out, name, "plain B")
        rw = _round_ratios(out, name, "plain B", "wall_s")
        out[name] = {
            "cpu_ratio": float(np.median(rc)),
            "cpu_ratio_ci": list(_bootstrap_ci([rc], _median)),
            "wall_ratio": float(np.median(rw)),
            "cpu_ms_per_micro_step": 1000 * float(np.median(steps_cpu[name])) / micro_steps,
            "wall_ms_per_micro_step": 1000 * float(np.median(wall[name])) / micro_steps,
            "cpu_ms_by_position": [1000 * float(np.median(p)) for p in by_position[name]],
        }
    return out


def time_case(model_kind, opt_name, batch, jit, micro_steps, rounds, log, copies=COPIES,
              names=None):
    """Times the variants (all, or those in `names`) of one case; see the
    module docstring and `time_variants`."""
    tf, _ = _tf()
    x, y = make_data(model_kind, batch * micro_steps)
    made = variants(opt_name)
    if names is not None:
        made = {k: made[k] for k in names}

    def fit_for(make_opt: Callable[[], Any], factor: int) -> Callable[[list], None]:
        model = make_model(model_kind)
        model.compile(optimizer=make_opt(), loss="mse", jit_compile=jit)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * factor).cache()

        def fit(callbacks: list) -> None:
            model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)

        for _ in range(3):  # trace, then untimed runs
            fit([])
        return fit

    return time_variants(made, fit_for, micro_steps, rounds, log, copies)


# (model, optimizer, B, micro-steps per fit, rounds). One cycle per `fit`,
# so that the variants take turns every few tenths of a second: with 64
# micro-steps per `fit`, the A/A ratio of single rounds spread 0.88-1.36 on
# a busy machine and 40 rounds left the skip target's interval 1.01-1.08;
# one cycle per `fit`, 150 rounds gave the A/A pair 0.99-1.01.
# The small MLP has no target: its micro-step of about 2 ms shows what each
# mode costs per micro-step whatever the model's size (its conditionals and
# bookkeeping in graph mode; see RESULTS.md).
UNTARGETED_MODELS = ("small",)
TIME_CASES = [
    ("mlp", "adam", 8, N, 150),
    ("mlp", "sgd", 8, N, 150),
    ("conv", "adam", 64, N, 100),
    ("small", "sgd", 8, N, 150),
]


def _case_key(model_kind: str, opt_name: str, batch: int, jit: bool) -> str:
    return f"{model_kind}/{opt_name}/B={batch}/{'jit' if jit else 'graph'}"


def time_case_keys() -> list[str]:
    return [_case_key(m, o, b, jit) for m, o, b, _, _ in TIME_CASES for jit in (False, True)]


def run_time(quick: bool, log, only: list[str] | None = None,
             rounds: int | None = None) -> dict:
    cases = TIME_CASES
    if quick:
        cases = [(m, o, b, N, 5) for m, o, b, _, _ in cases]
    results = {}
    for model_kind, opt_name, batch, steps, case_rounds in cases:
        case_rounds = rounds or case_rounds
        for jit in (False, True):
            key = _case_key(model_kind, opt_name, batch, jit)
            if only and not any(part in key for part in only):
                continue
            log(f"  time {key} ({steps} micro-steps x {case_rounds} rounds) ", end="")
            results[key] = time_case(model_kind, opt_name, batch, jit, steps, case_rounds, log)
    return results


# ----------------------------------------------------------------------
# Memory (one fresh process per variant).


def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _nbytes(variables) -> int:
    total = 0
    for v in variables:
        dtype = np.dtype(getattr(v.dtype, "name", v.dtype))
        total += int(np.prod(v.shape)) * dtype.itemsize
    return total


def _allocator_stats(tf, reset: bool = False) -> dict | None:
    """TensorFlow's CPU allocator statistics (`current`, `peak` bytes), or
    None where it keeps none: its CPU allocator is the oneDNN pool only where
    oneDNN is on (by default only on CPUs with AVX-512; `TF_ENABLE_ONEDNN_OPTS`
    decides), and the plain one raises on both calls."""
    try:
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
        return tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return None


def memory_child(variant: str, steps: int) -> dict:
    tf, keras = _tf()
    from gradaccum import accumulate

    batch = 8
    make = {
        "plain B": lambda: make_optimizer("adam"),
        "masked": lambda: accumulate(make_optimizer("adam"), N),
        "skip": lambda: accumulate(make_optimizer("adam"), N, mode="skip"),
        "keras": lambda: make_optimizer("adam", gradient_accumulation_steps=N),
        "masked, snapshot fallback": lambda: accumulate(make_optimizer("adam"), N),
    }[variant]
    if variant == "masked, snapshot fallback":
        from gradaccum._keras3 import Keras3Family

        Keras3Family.masks_writes = False
    x, y = make_data("big", batch * steps)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()
    model = make_model("big")
    opt = make()
    model.compile(optimizer=opt, loss="mse")
    model.fit(ds.take(2 * N), epochs=1, verbose=0)  # trace and build
    params = _nbytes(model.trainable_variables)
    opt_bytes = _nbytes(opt.variables)
    state = getattr(opt, "accumulation_state", None)
    acc_bytes = _nbytes(state.accumulators) if state is not None else 0
    # In-between micro-steps only (warm-up ended on an apply step).
    _allocator_stats(tf, reset=True)
    model.fit(ds.take(N - 1), epochs=1, verbose=0)
    tf_in_between = (_allocator_stats(tf) or {}).get("peak")
    model.fit(ds.take(1), epochs=1, verbose=0)
    rss_before = _rss_kib()
    tf_before = (_allocator_stats(tf) or {}).get("current")
    _reset_peak()
    _allocator_stats(tf, reset=True)
    model.fit(ds, epochs=1, verbose=0)
    peak = _rss_kib("VmHWM")
    tf_mem = _allocator_stats(tf) or {}
    return {
        "param_bytes": params,
        "optimizer_variable_bytes": opt_bytes,
        "accumulator_bytes": acc_bytes,
        "rss_before_kib": rss_before,
        "peak_kib": peak,
        "tf_before_bytes": tf_before,
        "tf_peak_bytes": tf_mem.get("peak"),
        "tf_peak_in_between_bytes": tf_in_between,
        "tf_after_bytes": tf_mem.get("current"),
    }


# The two CPU allocators a memory child runs under: TensorFlow's default and
# the system's `malloc` (see `run_memory`).
ALLOCATORS = {
    "pool": {},
    "system": {"TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"},
}


def _child(args: list[str], extra_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra_env or {})
    # What malloc frees goes back to the system at once (under the default
    # allocator TensorFlow's freed tensors stay resident regardless: see the
    # module docstring).
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    env["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.join(HERE, "..", "src"), env.get("PYTHONPATH", "")] if p
    )
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_memory(quick: bool, log) -> dict:
    """Each variant in fresh processes, under each allocator; medians over repeats.

    What each allocator's peaks mean is in the module docstring; under the
    system allocator TensorFlow keeps no allocator statistics, so only its
    resident peak is used. The variants take turns (one process of each, in
    an order rotated per repeat), so drift over the run falls on all of them
    alike.
    """
    steps = 4 * N if quick else 8 * N
    # Identical processes differ by up to 0.7x of the parameter bytes in peak
    # resident set size under the default allocator (one buffer of the
    # largest variable more or less): 9 processes per variant and allocator.
    repeats = 1 if quick else 9
    names = ["plain B", "masked", "skip", "keras", "masked, snapshot fallback"]
    log(f"  memory: {len(names)} variants x {len(ALLOCATORS)} allocators x {repeats} "
        f"processes ({steps} micro-steps each, ~25M parameters) ", end="")
    runs: dict[str, dict[str, list[dict]]] = {a: {name: [] for name in names} for a in ALLOCATORS}
    for rep in range(repeats):
        for name in rotated(names, rep):
            for allocator in rotated(list(ALLOCATORS), rep + names.index(name)):
                runs[allocator][name].append(
                    _child(["memory", name, str(steps)], ALLOCATORS[allocator])
                )
                log(".", end="")
    log("")
    results = {}
    for name in names:
        r = dict(runs["pool"][name][0])
        for key in ("peak_kib", "tf_peak_bytes", "tf_peak_in_between_bytes", "tf_before_bytes",
                    "rss_before_kib"):
            values = [run[key] for run in runs["pool"][name]]
            # None: the allocator keeps no statistics (see `_allocator_stats`).
            r[key] = None if None in values else float(np.median(values))
            r[key + "_runs"] = values
        values = [run["peak_kib"] for run in runs["system"][name]]
        r["peak_kib_system"] = float(np.median(values))
        r["peak_kib_system_runs"] = values
        results[name] = r
    base = results["plain B"]
    # extra key: (peak key, bytes per unit of the peak)
    extras = {
        "extra_rss_x_params": ("peak_kib", 1024),
        "extra_rss_system_x_params": ("peak_kib_system", 1024),
        "extra_tf_x_params": ("tf_peak_bytes", 1),
        "extra_tf_in_between_x_params": ("tf_peak_in_between_bytes", 1),
    }
    for r in results.values():
        for extra, (key, unit) in extras.items():
            r[extra] = (None if r[key] is None
                        else (r[key] - base[key]) * unit / r["param_bytes"])
    return results


# ----------------------------------------------------------------------
# Growth over 5,000 micro-steps (fresh process per variant).


def growth_child(variant: str, steps: int) -> dict:
    tf, keras = _tf()
    from gradaccum import accumulate

    make = {
        "plain B": lambda: make_optimizer("adam"),
        "masked": lambda: accumulate(make_optimizer("adam"), N),
        "skip": lambda: accumulate(make_optimizer("adam"), N, mode="skip"),
    }[variant]
    batch = 8
    x, y = make_data("small", batch * 100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache().repeat()
    model = make_model("small")
    model.compile(optimizer=make(), loss="mse")
    samples: list[tuple[int, int]] = []

    class Sample(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % 250 == 0:
                samples.append((batch + 1, _rss_kib()))

    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Sample()])
    return {"samples": samples}


def run_growth(quick: bool, log) -> dict:
    steps = 1000 if quick else 5000
    results = {}
    for name in ["plain B", "masked", "skip"]:
        log(f"  growth {name!r} ({steps} micro-steps)")
        samples = _child(["growth", name, str(steps)])["samples"]
        first = steps // 5  # skip warm-up (allocator and caches settling)
        xs = np.array([s for s, _ in samples if s >= first], float)
        rss = np.array([r for s, r in samples if s >= first], float) / 1024
        slope = float(np.polyfit(xs, rss, 1)[0]) * 1000 if len(xs) > 1 else 0.0
        results[name] = {
            "steps": steps,
            "rss_mib_at": {int(s): round(r / 1024, 1) for s, r in samples[:: max(1, len(samples) // 5)]},
            "growth_mib": float(rss[-1] - rss[0]),
            "slope_mib_per_1000_steps": slope,
            "from_step": first,
        }
    return results


# ----------------------------------------------------------------------
# Tracing.


@contextlib.contextmanager
def counting_updates(accumulation_class: type):
    """Counts Python runs of the update while active: of the accumulating
    core's micro-step (`accumulation_class.step`, patched) and of `apply` of
    the plain `CountingAdam` it yields. Yields `(calls, CountingAdam)`;
    `len(calls)` is the count (clear it between runs). Keras only."""
    import keras

    calls: list[int] = []
    original = accumulation_class.step

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    class CountingAdam(keras.optimizers.Adam):
        def apply(self, *args, **kwargs):
            calls.append(1)
            return super().apply(*args, **kwargs)

    accumulation_class.step = counting
    try:
        yield calls, CountingAdam
    finally:
        accumulation_class.step = original


def run_tracing(quick: bool, log) -> dict:
    """Python calls of the micro-step's code per `fit` (one per trace).

    With the optimizer built before `fit`, once per batch shape (Keras traces
    with an unknown batch size, so a last, smaller batch adds none). Unbuilt,
    `tf.function` traces twice on the first call because variables are
    created in it, as it does for the plain optimizer.
    """
    from gradaccum import accumulate
    from gradaccum._core import Core

    def traces(make_opt, n, build):
        calls.clear()
        x, y = make_data("small", 8 * n * 3 + 2)  # a last batch of 2
        model = make_model("small")
        opt = make_opt(n)
        if build:
            opt.build(model.trainable_variables)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return len(calls)

    results = {}
    with counting_updates(Core) as (calls, CountingAdam):
        for build in (True, False):
            when = "built" if build else "unbuilt"
            results[f"plain/{when}"] = traces(lambda n: CountingAdam(1e-4), 1, build)
            for mode in ("masked", "skip"):
                for n in (1, 2, 4, 8):
                    results[f"{mode}/n={n}/{when}"] = traces(
                        lambda n: accumulate(make_optimizer("adam"), n, mode=mode), n, build
                    )
    log(f"  tracing: {results}")
    return results


# ----------------------------------------------------------------------
# Report.


def _onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN kernels and allocator (None: unknown).
    It changes which kernels run and what the allocator keeps, so it belongs
    with the machine."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def machine() -> dict:
    tf, keras = _tf()
    import gradaccum
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "platform": platform.platform(),
        "onednn": _onednn_enabled(),
        "gradaccum": os.path.relpath(os.path.dirname(gradaccum.__file__), os.path.join(HERE, "..")),
    }


def _round_ratios(case: dict, a: str, b: str, key: str = "steps_cpu_s") -> np.ndarray:
    """Per round, variant `a`'s time over variant `b`'s (by default the CPU
    time of the train steps; `key` names another series of `case["_rounds"]`)."""
    times = case["_rounds"][key]
    return np.array(times[a]) / np.array(times[b])


def _bootstrap_ci(
    samples: list[np.ndarray],
    statistic: Callable[..., np.ndarray],
    level: float = 0.95,
    resamples: int = 10_000,
) -> tuple[float, float]:
    """Bootstrap confidence interval of `statistic(*samples)`.

    Each sample is resampled with replacement on its own; `statistic` takes
    arrays of shape `(resamples, len(sample))` and reduces over the last
    axis. A fixed seed, so a report reads the same twice.
    """
    rng = np.random.default_rng(0)
    drawn = [x[rng.integers(0, len(x), size=(resamples, len(x)))] for x in samples]
    values = statistic(*drawn)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def _median(x: np.ndarray) -> np.ndarray:
    return np.median(x, axis=-1)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _judged(interval: tuple[float, float], goal: float) -> str:
    """A target judged with its uncertainty: PASS if the whole 95% interval is
    within the goal, FAIL if all of it is beyond, "within noise" otherwise."""
    low, high = interval
    return "PASS" if high <= goal else "FAIL" if low > goal else "within noise"


def _target_row(name: str, value: float, interval: tuple[float, float], goal: float,
                digits: int) -> tuple[str, str, str, str]:
    """A row of the targets table: the value with its interval, and the verdict."""
    shown = f"{value:.{digits}f} [{interval[0]:.{digits}f}-{interval[1]:.{digits}f}]"
    return name, shown, f"<= {goal}", _judged(interval, goal)


def _timing_row(name: str, ratios: np.ndarray, goal: float) -> tuple[str, str, str, str]:
    """A target on the median of per-round ratios."""
    return _target_row(name, float(np.median(ratios)), _bootstrap_ci([ratios], _median),
                       goal, 3)


def _memory_row(name: str, mem: dict, key: str, goal: float) -> tuple[str, str, str, str]:
    """A target on the masked mode's median peak minus plain's, in parameter bytes."""
    if mem["masked"][key] is None or mem["plain B"][key] is None:
        return name, "n/a (the allocator keeps no statistics)", f"<= {goal}", "not measured"
    scale = {"peak_kib": 1024, "peak_kib_system": 1024, "tf_peak_bytes": 1}[key]
    scale /= mem["masked"]["param_bytes"]
    masked = np.array(mem["masked"][key + "_runs"], dtype=float) * scale
    plain = np.array(mem["plain B"][key + "_runs"], dtype=float) * scale
    interval = _bootstrap_ci([masked, plain], lambda a, b: _median(a) - _median(b))
    return _target_row(name, float(np.median(masked) - np.median(plain)), interval, goal, 2)


def report(res: dict, print_fn=print) -> None:
    p = print_fn
    m = res["machine"]
    onednn = {True: "on", False: "off", None: "unknown"}[m.get("onednn")]
    p(f"\nMachine: {m['cpu']}, {m['cores']} cores; {m['platform']}; Python {m['python']}, "
      f"TensorFlow {m['tensorflow']} (oneDNN {onednn}), Keras {m['keras']}")
    p(f"Load average (1 min) at start / end: {res['load'][0]:.2f} / {res['load'][1]:.2f}")
    if "time" in res:
        p("\nTime per micro-step, ratio to the plain optimizer at micro-batch B (median of "
          "per-round ratios: CPU time of the train steps [95% interval] / wall time of the fit)")
        names: list[str] = []
        for r in res["time"].values():
            names += [k for k in r if not k.startswith("_") and k not in names]
        header = "| case | " + " | ".join(names) + " |"
        p(header)
        p("|" + "---|" * (len(names) + 1))
        for case, r in res["time"].items():
            cells = [
                f"{r[n]['cpu_ratio']:.3f} [{r[n]['cpu_ratio_ci'][0]:.3f}-{r[n]['cpu_ratio_ci'][1]:.3f}]"
                f" / {r[n]['wall_ratio']:.2f}" if n in r else "-"
                for n in names
            ]
            p(f"| {case} | " + " | ".join(cells) + " |")
        p("\nPlain optimizer at B, ms per micro-step (median CPU of the train steps / "
          "wall of the fit):")
        for case, r in res["time"].items():
            p(f"  {case}: {r['plain B']['cpu_ms_per_micro_step']:.1f} / "
              f"{r['plain B']['wall_ms_per_micro_step']:.1f}")
        p("\nCPU ms of each train step of a cycle, by position (the last ends the cycle; "
          "median over rounds and copies):")
        for case, r in res["time"].items():
            cells = [f"{n} " + " ".join(f"{v:.2f}" for v in r[n]["cpu_ms_by_position"])
                     for n in names if n in r and "cpu_ms_by_position" in r[n]]
            p(f"  {case}: " + "; ".join(cells))
    if "memory" in res:
        mem = res["memory"]
        params = next(iter(mem.values()))["param_bytes"]
        p(f"\nMemory (~25M-parameter MLP, {params / 2**20:.0f} MiB of parameters; Adam, B=8, n=4; "
          "MiB, medians of fresh processes). Extra: peak minus the plain optimizer's peak, "
          "in multiples of the parameter bytes.")
        p("| variant | variables created: optimizer + accumulators | "
          "peak, TensorFlow allocator | "
          "extra | extra, in-between steps only | peak RSS, default allocator | extra | "
          "peak RSS, system allocator | extra |")
        p("|---|---|---|---|---|---|---|---|---|")
        def shown(value, fmt, unit=""):
            return "n/a" if value is None else format(value, fmt) + unit

        for name, r in mem.items():
            tf_peak = None if r["tf_peak_bytes"] is None else r["tf_peak_bytes"] / 2**20
            p(f"| {name} | {r['optimizer_variable_bytes'] / 2**20:.0f} + "
              f"{r['accumulator_bytes'] / 2**20:.0f} | "
              f"{shown(tf_peak, '.0f')} | "
              f"{shown(r['extra_tf_x_params'], '.2f', 'x')} | "
              f"{shown(r['extra_tf_in_between_x_params'], '.2f', 'x')} | "
              f"{r['peak_kib'] / 1024:.0f} | {r['extra_rss_x_params']:.2f}x | "
              f"{r['peak_kib_system'] / 1024:.0f} | {r['extra_rss_system_x_params']:.2f}x |")
    if "growth" in res:
        p("\nResident set size over many micro-steps (small MLP, Adam, B=8, n=4)")
        for name, r in res["growth"].items():
            p(f"  {name}: {r['rss_mib_at']} MiB; from step {r['from_step']} to {r['steps']}: "
              f"{r['growth_mib']:+.1f} MiB ({r['slope_mib_per_1000_steps']:+.2f} MiB per 1000 steps)")
    if "tracing" in res:
        p("\nTraces of the update per fit (3 epochs, batches of 8 and a last one of 2):")
        for when in ("built", "unbuilt"):
            row = {k.rsplit("/", 1)[0]: v for k, v in res["tracing"].items()
                   if k.rsplit("/", 1)[1] == when}
            p(f"  optimizer {when} before fit: {row}")

    p("\nTargets")
    rows = []
    if "time" in res:
        for exe in ("graph", "jit"):
            for case, a, b, target, label in (
                ("mlp/adam/B=8", "masked", "plain B", "masked_vs_plain_mlp_adam",
                 "masked / plain, MLP Adam B=8"),
                ("mlp/adam/B=8", "skip", "keras", "skip_vs_keras_mlp_adam",
                 "skip / Keras built-in, MLP Adam B=8"),
                ("conv/adam/B=64", "masked", "plain B", "masked_vs_plain_conv",
                 "masked / plain, conv B=64"),
            ):
                r = res["time"].get(f"{case}/{exe}")
                if r:
                    rows.append(_timing_row(f"{label}, {exe}", _round_ratios(r, a, b),
                                            TARGETS[target]))
        for exe in ("graph", "jit"):
            r = res["time"].get(f"mlp/sgd/B=8/{exe}")
            if r:
                rows.append(_timing_row(f"masked / plain, MLP SGD B=8, {exe}",
                                        _round_ratios(r, "masked", "plain B"),
                                        TARGETS[f"masked_vs_plain_mlp_sgd_{exe}"]))
        median_goal, upper_goal = TARGETS["skip_vs_keras"]
        for case, r in res["time"].items():
            if case.split("/")[0] in UNTARGETED_MODELS:
                continue
            ratios = _round_ratios(r, "skip", "keras")
            value = float(np.median(ratios))
            low, high = _bootstrap_ci([ratios], _median)
            ok = value <= median_goal and high <= upper_goal
            result = "PASS" if ok else "FAIL" if low > median_goal else "within noise"
            rows.append((f"skip / Keras built-in, {case}", f"{value:.3f} [{low:.3f}-{high:.3f}]",
                         f"<= {median_goal}, upper end <= {upper_goal}", result))
    if "memory" in res:
        t = TARGETS["masked_extra_memory"]
        rows.append(_memory_row("masked: extra peak memory, TensorFlow allocator (x parameter bytes)",
                                res["memory"], "tf_peak_bytes", t))
        rows.append(_memory_row("masked: extra peak RSS, default allocator (x parameter bytes)",
                                res["memory"], "peak_kib", t))
        rows.append(_memory_row("masked: extra peak RSS, system allocator (x parameter bytes)",
                                res["memory"], "peak_kib_system", t))
    if "tracing" in res:
        t = res["tracing"]
        for when in ("built", "unbuilt"):
            counts = sorted({v for k, v in t.items()
                             if k.rsplit("/", 1)[1] == when and not k.startswith("plain")})
            ok = counts == [t[f"plain/{when}"]]
            rows.append((f"traces per fit, any n, optimizer {when} (plain: {t[f'plain/{when}']})",
                         str(counts), f"[{t[f'plain/{when}']}]", verdict(ok)))
    if "growth" in res:
        for name in ("masked", "skip"):
            g = res["growth"][name]
            ok = abs(g["slope_mib_per_1000_steps"]) <= 1.0
            rows.append((f"{name}: no memory growth over {g['steps']} micro-steps",
                         f"{g['slope_mib_per_1000_steps']:+.2f} MiB/1000 steps", "|slope| <= 1", verdict(ok)))
    p("| target | measured | goal | verdict |")
    p("|---|---|---|---|")
    for name, v, goal, result in rows:
        p(f"| {name} | {v} | {goal} | {result} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--only", nargs="+", choices=["time", "memory", "growth", "tracing"])
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="time only the cases whose name contains one of these, e.g. conv")
    parser.add_argument("--rounds", type=int, metavar="R",
                        help="timing rounds per case (default 150, conv 100; 5 with --quick)")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be a positive integer, got {args.rounds}")
    unmatched = [part for part in args.cases or []
                 if not any(part in key for key in time_case_keys())]
    if unmatched:
        parser.error(f"--cases {unmatched} match no timing case; the cases are "
                     f"{time_case_keys()}")

    if args.child:
        kind, variant, steps = args.child
        fn = {"memory": memory_child, "growth": growth_child}[kind]
        print(json.dumps(fn(variant, int(steps))))
        return

    sys.path.insert(0, os.path.join(HERE, "..", "src"))

    def log(*a, **k):
        print(*a, **k, file=sys.stderr, flush=True)

    parts = args.only or ["tracing", "memory", "growth", "time"]
    res: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    load0 = os.getloadavg()[0]
    runners = {
        "time": functools.partial(run_time, only=args.cases, rounds=args.rounds),
        "memory": run_memory,
        "growth": run_growth,
        "tracing": run_tracing,
    }
    for part in parts:
        res[part] = runners[part](args.quick, log)
    res["load"] = (load0, os.getloadavg()[0])
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
