"""Speed, memory and tracing of `accumulate()` on Keras 3's JAX and PyTorch
backends, against the plain optimizer and Keras's `gradient_accumulation_steps`,
with each target and pass/fail. Runs on the active backend:

    KERAS_BACKEND=jax python benchmarks/backends.py            # about 10 minutes on 2 cores
    KERAS_BACKEND=torch python benchmarks/backends.py          # 20 to 25 minutes on 2 cores
    KERAS_BACKEND=jax python benchmarks/backends.py --quick    # smoke run
    KERAS_BACKEND=torch python benchmarks/backends.py --only time --rounds 40
    KERAS_BACKEND=jax python benchmarks/backends.py --only select   # select vs cond

The raw results go to `benchmarks/backends-<backend>.json` (or `--json`).
TensorFlow is not needed.

Method
------
The same as `bench.py`'s (see its docstring), on the active backend; the
model is `bench.py`'s MLP (1024-2048-1024-10, ~4.2M parameters) and Adam,
micro-batch B=8, n=4. JAX runs the train step under `jax.jit`
(`jit_compile=True`), PyTorch eagerly (`jit_compile=False`). The input is
numpy arrays.

Time: every variant lives in one process, twice (the copies created in
order, then in reverse order), each with its own model (same initial
weights) and optimizer, compiled and warmed up. Each round runs one
`model.fit` of one cycle (n micro-steps) for every copy, in an order rotated
from round to round. A callback takes the process CPU time (all threads) of
each train step (on JAX the callback converts the step's logs to numbers,
which waits for the step's computation); per round each variant's
train-step time (the mean of its copies) is divided by the plain
optimizer's, and the table gives the median of these per-round ratios with
a 95% bootstrap interval over rounds, and the median ratio of the wall time
of the whole `fit`. "plain B (A/A)" is a second, identical plain optimizer:
its ratio shows the noise. Skip mode is also compared with Keras's option
round by round (skip's time over Keras's).

Tracing: how often `fit` runs the accumulation's Python code (the
micro-step of the core for JAX and PyTorch; the plain optimizer's `apply`) per `fit` of 3
epochs with batches of 8 and a last one of 2. Under `jax.jit` that is once
per trace: the plain optimizer is traced once per batch shape, and the
accumulating one must be traced as often, for any n. Setting `opt.n`
between two `fit` calls must not trace again (n is read from a variable of
the optimizer state). PyTorch runs eagerly: Python runs on every micro-step,
nothing is traced, so nothing can be retraced; the count is reported per
micro-step.

Memory: on a ~25.2M-parameter MLP (`bench.py`'s "big"), (1) the bytes of
the optimizer's variables (`opt.variables`: for an accumulating optimizer
the wrapped optimizer's, then the accumulation state's) and (2) the peak
resident set size of fresh processes (`VmHWM`, reset through
`/proc/self/clear_refs` after warm-up, over 8 cycles of `fit`), several
processes per variant, the variants taking turns; `malloc` hands large
freed blocks back at once. "extra" is a variant's figure minus the plain
optimizer's, in multiples of the parameter bytes; for the peaks, the
difference of the medians over processes, with a 95% bootstrap interval.

Select against cond (JAX only, `--only select`; part of the default run on
JAX): why the update runs under `jax.lax.cond` rather than being computed on
every micro-step and selected back. Plain jitted JAX, no Keras: Adam on the
MLP's shapes (~4.2M float32 elements) with the state (parameters, m, v,
accumulators, counters) donated to every step; (a) a plain Adam step, (b)
add into the accumulators, then Adam on their mean on every micro-step, kept
by `jnp.where(ends, new, old)` on parameters, m and v, (c) add, then
`lax.cond(ends, adam-and-clear, identity)`, (d) the library's form: the
first micro-step of a cycle writes over the accumulators, and the cond
leaves them alone, (e) add only. The CPU time of every cycle
of n steps is taken (so the cond's one update in n is in each figure), 2
cycles per variant and round, variants in rotated order, 10 rounds; ratio =
a variant's median over cycles / plain Adam's, with a 95% bootstrap interval
over cycles.

A target passes only if its whole 95% interval is within the goal, fails if
all of it is beyond, and is "within noise" otherwise (skip against Keras's
option: the median at most 1.00 and the interval's upper end at most 1.02,
as in `bench.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Pure numpy helpers; importing `bench` does not import TensorFlow.
from bench import (  # noqa: E402
    TARGETS,
    _bootstrap_ci,
    _judged,
    _median,
    _nbytes,
    _reset_peak,
    _rss_kib,
    counting_updates,
    make_data,
    rotated,
    time_variants,
)

N = 4  # micro-batches per update
B = 8  # micro-batch size
COPIES = 2
ROUNDS = {"jax": 150, "torch": 80}
MEMORY_REPEATS = 5
MEMORY_VARIANTS = ["plain B", "masked", "skip", "keras"]


def backend() -> str:
    import keras

    return keras.config.backend()


def jit() -> bool:
    return backend() == "jax"


# ----------------------------------------------------------------------
# Models, optimizers and variants.


def make_model(kind: str, seed: int = 0):
    """`bench.py`'s models "mlp" (~4.2M parameters) and "big" (~25.2M) and
    "small" (~85K), built with Keras layers on the active backend."""
    import keras

    keras.utils.set_random_seed(seed)
    widths, inputs = {
        "mlp": ([2048, 1024], 1024),
        "big": ([4096, 4096, 1024], 1024),
        "small": ([256, 256], 64),
    }[kind]
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers, name=kind)


def make_optimizer(**kwargs):
    import keras

    return keras.optimizers.Adam(1e-4, **kwargs)


def variants() -> dict[str, tuple[Callable[[], Any], int]]:
    """name -> (how to make the optimizer, batch size as a multiple of B)."""
    from gradaccum import accumulate

    return {
        "plain B": (make_optimizer, 1),
        "plain B (A/A)": (make_optimizer, 1),
        "masked": (lambda: accumulate(make_optimizer(), N, mode="masked"), 1),
        "skip": (lambda: accumulate(make_optimizer(), N, mode="skip"), 1),
        "keras": (lambda: make_optimizer(gradient_accumulation_steps=N), 1),
        "plain B*n": (make_optimizer, N),
    }


# ----------------------------------------------------------------------
# Time.


def run_time(rounds: int, log) -> dict:
    x, y = make_data("mlp", B * N)
    made = variants()
    log(f"  time: {COPIES * len(made)} models, {N} micro-steps x {rounds} rounds ", end="")

    def fit_for(make_opt: Callable[[], Any], factor: int) -> Callable[[list], None]:
        model = make_model("mlp")
        model.compile(optimizer=make_opt(), loss="mse", jit_compile=jit())

        def fit(callbacks: list) -> None:
            model.fit(x, y, batch_size=B * factor, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)

        for _ in range(3):  # trace, then untimed runs
            fit([])
        return fit

    out = time_variants(made, fit_for, N, rounds, log, COPIES)
    out["rounds"] = rounds
    steps_cpu, wall = out["_rounds"]["steps_cpu_s"], out["_rounds"]["wall_s"]
    sk = np.array(steps_cpu["skip"]) / np.array(steps_cpu["keras"])
    out["skip / keras"] = {"cpu_ratio": float(np.median(sk)),
                           "cpu_ratio_ci": list(_bootstrap_ci([sk], _median)),
                           "wall_ratio": float(np.median(np.array(wall["skip"]) /
                                                         np.array(wall["keras"])))}
    return out


# ----------------------------------------------------------------------
# Tracing.


def run_tracing(log) -> dict:
    import keras

    from gradaccum import accumulate

    # The core that runs on this backend (its module is private: found
    # through an accumulating optimizer).
    core_class = type(accumulate(make_optimizer(), 2)._self_core)

    def traces(opt, n, build):
        """Python calls of the update in one `fit` of 3 epochs, and the number
        of micro-steps it ran."""
        calls.clear()
        x, y = make_data("small", B * n * 3 + 2)  # a last batch of 2
        model = make_model("small")
        if build:
            opt.build(model.trainable_variables)
        model.compile(optimizer=opt, loss="mse", jit_compile=jit())
        model.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0)
        return {"calls": len(calls), "steps": 3 * (3 * n + 1)}

    results: dict[str, Any] = {}
    with counting_updates(core_class) as (calls, CountingAdam):
        for build in (True, False):
            when = "built" if build else "unbuilt"
            results[f"plain/{when}"] = traces(CountingAdam(1e-4), 1, build)
            for mode in ("masked", "skip"):
                for n in (1, 2, 4, 8):
                    results[f"{mode}/n={n}/{when}"] = traces(
                        accumulate(make_optimizer(), n, mode=mode), n, build)
        # Setting `n` between two `fit` calls.
        for mode in ("masked", "skip"):
            x, y = make_data("small", B * 5)
            model = make_model("small")
            opt = accumulate(make_optimizer(), 4, mode=mode)
            model.compile(optimizer=opt, loss="mse", jit_compile=jit())
            calls.clear()
            model.fit(x[: B * 4], y[: B * 4], batch_size=B, epochs=1, shuffle=False, verbose=0)
            first = len(calls)
            iterations_before = int(keras.ops.convert_to_numpy(opt.iterations))
            opt.n = 8
            calls.clear()
            model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)  # 5 micro-steps
            results[f"set n/{mode}"] = {
                "calls_first_fit": first,
                "calls_after_setting_n": len(calls),
                "steps_after_setting_n": 5,
                # With n=8 in effect, 5 micro-steps apply nothing.
                "micro_step_after": int(keras.ops.convert_to_numpy(opt.micro_step)),
                "updates_applied_after": int(keras.ops.convert_to_numpy(opt.iterations))
                - iterations_before,
            }
    log(f"  tracing: {results}")
    return results


# ----------------------------------------------------------------------
# Memory.


def memory_child(variant: str, steps: int) -> dict:
    import keras  # noqa: F401

    from gradaccum import accumulate

    make = {
        "plain B": make_optimizer,
        "masked": lambda: accumulate(make_optimizer(), N, mode="masked"),
        "skip": lambda: accumulate(make_optimizer(), N, mode="skip"),
        "keras": lambda: make_optimizer(gradient_accumulation_steps=N),
    }[variant]
    x, y = make_data("big", B * steps)
    model = make_model("big")
    opt = make()
    model.compile(optimizer=opt, loss="mse", jit_compile=jit())
    warm = 2 * N
    model.fit(x[: B * warm], y[: B * warm], batch_size=B, shuffle=False, verbose=0)
    params = _nbytes(model.trainable_variables)
    opt_bytes = _nbytes(opt.variables)
    wrapped = getattr(opt, "__wrapped__", None)
    wrapped_bytes = _nbytes(wrapped.variables) if wrapped is not None else opt_bytes
    peak_warm_up = _rss_kib("VmHWM")
    rss_before = _rss_kib()
    _reset_peak()
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return {
        "param_bytes": params,
        "optimizer_variable_bytes": opt_bytes,
        "wrapped_optimizer_variable_bytes": wrapped_bytes,
        "peak_kib_with_warm_up": peak_warm_up,
        "rss_before_kib": rss_before,
        "peak_kib": _rss_kib("VmHWM"),
    }


def _child(args: list[str]) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    env["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.join(HERE, "..", "src"), env.get("PYTHONPATH", "")] if p
    )
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_memory(repeats: int, steps: int, log) -> dict:
    names = MEMORY_VARIANTS
    log(f"  memory: {len(names)} variants x {repeats} processes ({steps} micro-steps each, "
        "~25M parameters) ", end="")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in rotated(names, rep):
            runs[name].append(_child(["memory", name, str(steps)]))
            log(".", end="")
    log("")
    results = {}
    for name in names:
        r = dict(runs[name][0])
        for key in ("peak_kib", "peak_kib_with_warm_up", "rss_before_kib"):
            values = [run[key] for run in runs[name]]
            r[key] = float(np.median(values))
            r[key + "_runs"] = values
        results[name] = r
    base = results["plain B"]
    for r in results.values():
        params = r["param_bytes"]
        r["extra_variables_x_params"] = (
            r["optimizer_variable_bytes"] - base["optimizer_variable_bytes"]) / params
        for key in ("peak_kib", "peak_kib_with_warm_up", "rss_before_kib"):
            scale = 1024 / params
            ours = np.array(r[key + "_runs"], float) * scale
            plain = np.array(base[key + "_runs"], float) * scale
            r[f"extra_{key}_x_params"] = float(np.median(ours) - np.median(plain))
            r[f"extra_{key}_x_params_ci"] = list(_bootstrap_ci(
                [ours, plain], lambda a, b: _median(a) - _median(b)))
    return results


# ----------------------------------------------------------------------
# Select against cond (JAX only): the design choice, measured in plain JAX.

SELECT_ROUNDS = 10
SELECT_CYCLES = 2  # cycles of n micro-steps per variant and round


def run_select(rounds: int, log) -> dict:
    """A masked update written as a select, against one under `lax.cond`, in
    plain jitted JAX (no Keras): Adam on the MLP's shapes (~4.2M float32
    elements), the state (parameters, m, v, accumulators, counters) donated
    to every step. Variants: "plain" (an Adam step on every call),
    "select" (add into the accumulators, then Adam on their mean on every
    micro-step, kept by `jnp.where(ends, new, old)` on parameters, m, v;
    the accumulators cleared by a select), "cond" (add, then
    `lax.cond(ends, adam-and-clear, identity)`), "cond, cleared lazily" (the
    library's form: a cycle's first micro-step writes its gradients over the
    accumulators, `lax.cond(ends, adam, identity)` leaves them as they are),
    "accumulate only" (add and count). Each variant's CPU time is taken per cycle of n micro-steps (so
    the cond's one update in n is in every figure), the variants
    interleaved, `SELECT_CYCLES` cycles each per round, in rotated order;
    ratio = a variant's median over cycles / plain's, with a 95% bootstrap
    interval over cycles."""
    import jax
    import jax.numpy as jnp

    shapes = [(1024, 2048), (2048,), (2048, 1024), (1024,), (1024, 10), (10,)]
    lr, b1, b2, eps = 1e-4, 0.9, 0.999, 1e-7
    rng = np.random.default_rng(0)
    grads = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 1e-2) for s in shapes]
    elements = sum(int(np.prod(s)) for s in shapes)

    def fresh():  # the same initial state for every variant
        start = np.random.default_rng(1)
        p = [jnp.asarray(start.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes]
        z = lambda: [jnp.zeros(s, jnp.float32) for s in shapes]  # noqa: E731
        return {"p": p, "m": z(), "v": z(), "acc": z(),
                "micro": jnp.zeros((), jnp.int32), "t": jnp.zeros((), jnp.float32)}

    def adam(p, m, v, t, g):
        t = t + 1
        alpha = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        m = [mi + (gi - mi) * (1 - b1) for mi, gi in zip(m, g)]
        v = [vi + (gi * gi - vi) * (1 - b2) for vi, gi in zip(v, g)]
        p = [pi - alpha * mi / (jnp.sqrt(vi) + eps) for pi, mi, vi in zip(p, m, v)]
        return p, m, v, t

    def add(s, g):
        acc = [a + gi for a, gi in zip(s["acc"], g)]
        micro = s["micro"] + 1
        return acc, micro, micro % N == 0

    def plain(s, g):
        p, m, v, t = adam(s["p"], s["m"], s["v"], s["t"], g)
        return {**s, "p": p, "m": m, "v": v, "t": t}

    def select(s, g):
        acc, micro, ends = add(s, g)
        p, m, v, t = adam(s["p"], s["m"], s["v"], s["t"], [a / N for a in acc])
        keep = lambda new, old: [jnp.where(ends, a, b) for a, b in zip(new, old)]  # noqa: E731
        return {"p": keep(p, s["p"]), "m": keep(m, s["m"]), "v": keep(v, s["v"]),
                "acc": [jnp.where(ends, jnp.zeros_like(a), a) for a in acc],
                "micro": micro, "t": jnp.where(ends, t, s["t"])}

    def cond(s, g):
        acc, micro, ends = add(s, g)

        def update(p, m, v, t, acc):
            p, m, v, t = adam(p, m, v, t, [a / N for a in acc])
            return p, m, v, t, [jnp.zeros_like(a) for a in acc]

        def keep(p, m, v, t, acc):
            return p, m, v, t, acc

        p, m, v, t, acc = jax.lax.cond(ends, update, keep, s["p"], s["m"], s["v"], s["t"], acc)
        return {"p": p, "m": m, "v": v, "acc": acc, "micro": micro, "t": t}

    def cond_lazy(s, g):
        # The library's form: the accumulators are not cleared after the
        # update; a cycle's first micro-step writes over them.
        fresh = s["micro"] % N == 0
        acc = [jnp.where(fresh, gi, a + gi) for a, gi in zip(s["acc"], g)]
        micro = s["micro"] + 1
        ends = micro % N == 0

        def update(p, m, v, t):
            return adam(p, m, v, t, [a / N for a in acc])

        p, m, v, t = jax.lax.cond(ends, update, lambda *x: x, s["p"], s["m"], s["v"], s["t"])
        return {"p": p, "m": m, "v": v, "acc": acc, "micro": micro, "t": t}

    def accumulate_only(s, g):
        acc, micro, _ = add(s, g)
        return {**s, "acc": acc, "micro": micro}

    made = {"plain": plain, "select": select, "cond": cond, "cond, cleared lazily": cond_lazy,
            "accumulate only": accumulate_only}
    steps = {k: jax.jit(f, donate_argnums=0) for k, f in made.items()}
    states = {k: fresh() for k in made}
    # Warm up (compile), and check that select and cond compute the same.
    for k in made:
        for _ in range(2 * N):
            states[k] = steps[k](states[k], grads)
        jax.block_until_ready(states[k])
    same = all(bool(jnp.allclose(a, b, rtol=1e-5, atol=1e-7))
               for other in ("cond", "cond, cleared lazily")
               for a, b in zip(states["select"]["p"] + states["select"]["m"],
                               states[other]["p"] + states[other]["m"]))
    names = list(made)
    log(f"  select: {len(names)} variants x {rounds} rounds x {SELECT_CYCLES} cycles ", end="")
    cpu = {k: [] for k in names}
    wall = {k: [] for k in names}
    for r in range(rounds):
        for k in rotated(names, r):
            for _ in range(SELECT_CYCLES):
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(N):
                    states[k] = steps[k](states[k], grads)
                jax.block_until_ready(states[k])
                cpu[k].append((time.process_time() - c0) / N)
                wall[k].append((time.perf_counter() - w0) / N)
        log(".", end="")
    log("")
    out: dict[str, Any] = {"rounds": rounds, "cycles_per_round": SELECT_CYCLES, "n": N,
                           "elements": elements, "select_equals_cond": same,
                           "_cycles": {"cpu_s_per_micro_step": cpu, "wall_s_per_micro_step": wall}}
    base_cpu, base_wall = np.array(cpu["plain"]), np.array(wall["plain"])
    for k in names:
        ours = np.array(cpu[k])
        out[k] = {
            "cpu_ms_per_micro_step": 1000 * float(np.median(ours)),
            "wall_ms_per_micro_step": 1000 * float(np.median(wall[k])),
            "cpu_ratio": float(np.median(ours) / np.median(base_cpu)),
            "cpu_ratio_ci": list(_bootstrap_ci(
                [ours, base_cpu], lambda a, b: _median(a) / _median(b))),
            "wall_ratio": float(np.median(wall[k]) / np.median(base_wall)),
        }
    sc = np.array(cpu["select"]), np.array(cpu["cond"])
    out["select / cond"] = {"cpu_ratio": float(np.median(sc[0]) / np.median(sc[1])),
                            "cpu_ratio_ci": list(_bootstrap_ci(
                                list(sc), lambda a, b: _median(a) / _median(b)))}
    return out


# ----------------------------------------------------------------------
# Report.


def machine() -> dict:
    import keras

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "keras": keras.__version__,
        "backend": keras.config.backend(),
        "platform": platform.platform(),
    }
    if out["backend"] == "jax":
        import jax
        import jaxlib

        out["jax"] = jax.__version__
        out["jaxlib"] = jaxlib.__version__
    elif out["backend"] == "torch":
        import torch

        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
    return out


def _interval(value: float, ci: list[float] | tuple[float, float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}-{ci[1]:.{digits}f}]"


def report(res: dict, print_fn=print) -> None:
    p = print_fn
    m = res["machine"]
    engine = f"JAX {m['jax']}" if "jax" in m else f"PyTorch {m.get('torch')}"
    p(f"\nMachine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, Keras {m['keras']}, "
      f"{engine}; backend {m['backend']} ({'jit' if m['backend'] == 'jax' else 'eager'})")
    p(f"Load average (1 min) at start / end: {res['load'][0]:.2f} / {res['load'][1]:.2f}")
    rows = []
    if "time" in res:
        t = res["time"]
        names = [k for k in t if not k.startswith("_") and k not in ("rounds", "skip / keras")]
        p(f"\nTime per micro-step, MLP (~4.2M parameters), Adam, B={B}, n={N}; ratio to the "
          f"plain optimizer at B, median of {t['rounds']} per-round ratios: CPU time of the "
          "train steps [95% interval] / wall time of the fit")
        p("| variant | CPU ratio [95% interval] | wall ratio | CPU ms per micro-step |")
        p("|---|---|---|---|")
        for n in names:
            p(f"| {n} | {_interval(t[n]['cpu_ratio'], t[n]['cpu_ratio_ci'])} | "
              f"{t[n]['wall_ratio']:.2f} | {t[n]['cpu_ms_per_micro_step']:.1f} |")
        sk = t["skip / keras"]
        p(f"| skip / keras (per round) | {_interval(sk['cpu_ratio'], sk['cpu_ratio_ci'])} | "
          f"{sk['wall_ratio']:.2f} | |")
        rows.append(("masked / plain, MLP Adam B=8",
                     _interval(t["masked"]["cpu_ratio"], t["masked"]["cpu_ratio_ci"]),
                     f"<= {TARGETS['masked_vs_plain_mlp_adam']}",
                     _judged(t["masked"]["cpu_ratio_ci"], TARGETS["masked_vs_plain_mlp_adam"])))
        median_goal, upper_goal = TARGETS["skip_vs_keras"]
        low, high = sk["cpu_ratio_ci"]
        ok = sk["cpu_ratio"] <= median_goal and high <= upper_goal
        rows.append(("skip / Keras built-in, MLP Adam B=8",
                     _interval(sk["cpu_ratio"], sk["cpu_ratio_ci"]),
                     f"<= {median_goal}, upper end <= {upper_goal}",
                     "PASS" if ok else "FAIL" if low > median_goal else "within noise"))
    if "memory" in res:
        mem = res["memory"]
        params = next(iter(mem.values()))["param_bytes"]
        reps = len(next(iter(mem.values()))["peak_kib_runs"])
        p(f"\nMemory (~25M-parameter MLP, {params / 2**20:.0f} MiB of parameters; Adam, B={B}, "
          f"n={N}; MiB; peaks are medians of {reps} fresh processes). Extra: minus the plain "
          "optimizer's, in multiples of the parameter bytes [95% interval].")
        p("| variant | optimizer variables | extra | peak RSS over training | extra | "
          "peak RSS incl. compile/warm-up | extra |")
        p("|---|---|---|---|---|---|---|")
        for name, r in mem.items():
            extra = {key: _interval(r[f"extra_{key}_x_params"], r[f"extra_{key}_x_params_ci"], 2)
                     for key in ("peak_kib", "peak_kib_with_warm_up")}
            p(f"| {name} | {r['optimizer_variable_bytes'] / 2**20:.0f} | "
              f"{r['extra_variables_x_params']:.2f}x | {r['peak_kib'] / 1024:.0f} | "
              f"{extra['peak_kib']}x | {r['peak_kib_with_warm_up'] / 1024:.0f} | "
              f"{extra['peak_kib_with_warm_up']}x |")
        goal = TARGETS["masked_extra_memory"]
        r = mem["masked"]
        rows.append(("masked: extra optimizer variables (x parameter bytes)",
                     f"{r['extra_variables_x_params']:.2f}", f"<= {goal}",
                     "PASS" if r["extra_variables_x_params"] <= goal else "FAIL"))
        rows.append(("masked: extra peak RSS over training (x parameter bytes)",
                     _interval(r["extra_peak_kib_x_params"], r["extra_peak_kib_x_params_ci"], 2),
                     f"<= {goal}", _judged(r["extra_peak_kib_x_params_ci"], goal)))
    if "tracing" in res:
        tr = res["tracing"]
        eager = res["machine"]["backend"] != "jax"
        p("\nPython calls of the update per fit (3 epochs, batches of 8 and a last one of 2): "
          "calls / micro-steps")
        for when in ("built", "unbuilt"):
            row = {k.rsplit("/", 1)[0]: f"{v['calls']}/{v['steps']}" for k, v in tr.items()
                   if k.rsplit("/", 1)[-1] == when}
            p(f"  optimizer {when} before fit: {row}")
        for mode in ("masked", "skip"):
            s = tr[f"set n/{mode}"]
            p(f"  {mode}: n=4, fit of 4 micro-steps ({s['calls_first_fit']} calls); opt.n = 8; "
              f"fit of 5 micro-steps: {s['calls_after_setting_n']} calls, micro_step after it "
              f"{s['micro_step_after']}, updates applied {s['updates_applied_after']}")
        for when in ("built", "unbuilt"):
            plain = tr[f"plain/{when}"]
            ours = {k: v for k, v in tr.items()
                    if k.rsplit("/", 1)[-1] == when and not k.startswith(("plain", "set n"))}
            if eager:
                ok = all(v["calls"] == v["steps"] for v in ours.values()) \
                    and plain["calls"] == plain["steps"]
                rows.append((f"no retracing, any n, optimizer {when}",
                             "eager: Python runs once per micro-step ("
                             + ("all" if ok else "NOT all") + "), nothing is traced",
                             "no traces", "n/a (nothing traced)"))
            else:
                counts = sorted({v["calls"] for v in ours.values()})
                rows.append((f"traces per fit, any n, optimizer {when} (plain: {plain['calls']})",
                             str(counts), f"[{plain['calls']}]",
                             "PASS" if counts == [plain["calls"]] else "FAIL"))
        if not eager:
            s = [tr[f"set n/{mode}"] for mode in ("masked", "skip")]
            ok = all(v["calls_after_setting_n"] == 0 and v["micro_step_after"] == 5
                     and v["updates_applied_after"] == 0 for v in s)
            rows.append(("opt.n = 8 between fits: new traces (masked, skip)",
                         str([v["calls_after_setting_n"] for v in s]), "[0, 0], and n=8 in effect",
                         "PASS" if ok else "FAIL"))
    if "select" in res:
        s = res["select"]
        p(f"\nSelect against cond in plain jitted JAX: Adam on {s['elements'] / 1e6:.1f}M float32 "
          f"elements, state donated, n={s['n']}; CPU time per micro-step (per cycle of n), "
          f"median of {s['rounds'] * s['cycles_per_round']} cycles; ratio to plain Adam "
          f"[95% interval]; select and both conds agree: {s['select_equals_cond']}")
        p("| variant | CPU ms per micro-step | CPU ratio [95% interval] | wall ratio |")
        p("|---|---|---|---|")
        for name in ("plain", "select", "cond", "cond, cleared lazily", "accumulate only"):
            p(f"| {name} | {s[name]['cpu_ms_per_micro_step']:.2f} | "
              f"{_interval(s[name]['cpu_ratio'], s[name]['cpu_ratio_ci'], 2)} | "
              f"{s[name]['wall_ratio']:.2f} |")
        sc = s["select / cond"]
        p(f"| select / cond | | {_interval(sc['cpu_ratio'], sc['cpu_ratio_ci'], 2)} | |")
    p("\nTargets")
    p("| target | measured | goal | verdict |")
    p("|---|---|---|---|")
    for name, v, goal, result in rows:
        p(f"| {name} | {v} | {goal} | {result} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--only", nargs="+", choices=["time", "memory", "tracing", "select"],
                        help="parts to run (default: all; \"select\" on JAX only)")
    parser.add_argument("--rounds", type=int, metavar="R",
                        help="timing rounds (default 150 on JAX, 80 on PyTorch; 5 with --quick)")
    parser.add_argument("--repeats", type=int, metavar="P",
                        help=f"processes per variant for memory (default {MEMORY_REPEATS})")
    parser.add_argument("--json", help="where to write the raw results "
                        "(default benchmarks/backends-<backend>.json)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be a positive integer, got {args.rounds}")

    if args.child:
        kind, variant, steps = args.child
        print(json.dumps({"memory": memory_child}[kind](variant, int(steps))))
        return

    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    name = backend()
    if name not in ("jax", "torch"):
        parser.error(f"the active Keras backend is {name!r}; set KERAS_BACKEND=jax or torch "
                     "(bench.py measures TensorFlow)")

    def log(*a, **k):
        print(*a, **k, file=sys.stderr, flush=True)

    parts = args.only or ["tracing", "memory", "time"] + (["select"] if name == "jax" else [])
    if "select" in parts and name != "jax":
        parser.error("--only select measures plain JAX; set KERAS_BACKEND=jax")
    res: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    load0 = os.getloadavg()[0]
    for part in parts:
        started = time.perf_counter()
        if part == "time":
            rounds = args.rounds or (5 if args.quick else ROUNDS[name])
            res["time"] = run_time(rounds, log)
        elif part == "select":
            res["select"] = run_select(2 if args.quick else SELECT_ROUNDS, log)
        elif part == "memory":
            repeats = args.repeats or (1 if args.quick else MEMORY_REPEATS)
            res["memory"] = run_memory(repeats, 4 * N if args.quick else 8 * N, log)
        else:
            res["tracing"] = run_tracing(log)
        log(f"  ({part}: {time.perf_counter() - started:.0f} s)")
    res["load"] = (load0, os.getloadavg()[0])
    report(res)
    path = args.json or os.path.join(HERE, f"backends-{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    log(f"  results written to {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
