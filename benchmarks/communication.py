"""What accumulation costs in communication under `tf.distribute`, per cycle.

    python benchmarks/communication.py              # both strategies (~10 minutes)
    python benchmarks/communication.py --rounds 5   # smoke run
    python benchmarks/communication.py --only mirrored --json out.json

Two set-ups, each in processes of its own:

- `MirroredStrategy` over 2 logical CPU devices in one process;
- `MultiWorkerMirroredStrategy` over 2 worker processes on loopback ports
  (one CPU replica each; gRPC collectives).

Each trains the benchmark's MLP (`bench.make_model("mlp")`, 4.2M float32
parameters, 16.8 MB of gradients) with Adam in a custom loop
(`strategy.run` inside one `tf.function`, as `model.fit` cannot run under
MultiWorkerMirroredStrategy in Keras 3.15), `B` = 8 samples per replica per
micro-step, `n` = 4. Variants, one cycle each (the same samples per cycle):
plain at `B` (n steps), plain at `B*n` (one step), gradaccum masked and skip
(n micro-steps), and Keras's own `gradient_accumulation_steps` (which fails
under these strategies: its `tf.cond` encloses the update's merge calls;
the error is reported).

Counted, per replica and cycle, at run time: each call of
`ReplicaContext.all_reduce` (the call every Keras 3 optimizer and gradaccum
make to reduce over replicas) adds 1 and the bytes of what it reduces to
two counters, inside the branch it is traced in, so a reduction in a branch
not taken is not counted. Timed: CPU time of the process and wall time per
cycle; rounds rotate the order of the variants (as in `bench.py`) and the
table gives the median of per-round ratios to plain at `B` with a 95%
bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import bench  # noqa: E402

from tests.helpers.processes import free_loopback_ports, process_env  # noqa: E402

N = 4
B = 8  # per replica
VARIANTS = ["plain B", "plain B (A/A)", "masked", "skip", "keras", "plain B*n"]


def _counting_all_reduces(tf):
    """Patches `ReplicaContext.all_reduce` to count calls and bytes at run
    time; returns the two counters (int64 variables)."""
    calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_calls")
    moved = tf.Variable(0, dtype=tf.int64, trainable=False, name="all_reduce_bytes")
    original = tf.distribute.ReplicaContext.all_reduce

    def all_reduce(self, reduce_op, value, options=None):
        size = 0
        for t in tf.nest.flatten(value, expand_composites=False):
            values = t.values if isinstance(t, tf.IndexedSlices) else t
            size += int(np.prod(values.shape)) * values.dtype.size
        out = original(self, reduce_op, value, options)
        with tf.control_dependencies(tf.nest.flatten(out, expand_composites=True)):
            calls.assign_add(1)
            moved.assign_add(size)
        return out

    tf.distribute.ReplicaContext.all_reduce = all_reduce
    return calls, moved


def _make_optimizer(variant: str):
    import keras

    from gradaccum import accumulate

    adam = lambda **kw: keras.optimizers.Adam(1e-4, **kw)  # noqa: E731
    if variant == "masked":
        return accumulate(adam(), N)
    if variant == "skip":
        return accumulate(adam(), N, mode="skip")
    if variant == "keras":
        return adam(gradient_accumulation_steps=N)
    return adam()


def run_child(kind: str, rounds: int) -> dict:
    """Runs every variant under one strategy; returns per-round records."""
    import tensorflow as tf

    if kind == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        local_replicas = 2
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        local_replicas = 1
    import keras

    calls, moved = _counting_all_reduces(tf)
    replicas = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    runs: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for variant in VARIANTS:
        factor = N if variant == "plain B*n" else 1
        steps = 1 if variant == "plain B*n" else N
        x = tf.constant(rng.normal(size=(B * factor, 1024)).astype("float32"))
        y = tf.constant(rng.normal(size=(B * factor, 10)).astype("float32"))
        with strategy.scope():
            model = bench.make_model("mlp")
            opt = _make_optimizer(variant)
            opt.build(model.trainable_variables)
        loss_fn = keras.losses.MeanSquaredError(reduction=None)
        global_batch = B * factor * replicas

        def make_step(model=model, opt=opt, x=x, y=y, global_batch=global_batch):
            def replica_step():
                with tf.GradientTape() as tape:
                    per_example = loss_fn(y, model(x, training=True))
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            @tf.function
            def step():
                strategy.run(replica_step)

            return step

        step = make_step()
        try:
            for _ in range(2 * steps):  # trace, then one untimed cycle
                step()
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            # A traced error's message starts with the traceback; keep the
            # line that names the cause.
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            causes = [line for line in lines if "Error" in line or "merge_call" in line]
            errors[variant] = f"{type(e).__name__}: {(causes or lines or [''])[0][:300]}"
            continue
        runs[variant] = (step, steps)
    names = list(runs)
    records = {k: {"cpu_s": [], "wall_s": [], "all_reduces": [], "bytes": []} for k in names}
    for r in range(rounds):
        for name in bench.rotated(names, r):
            step, steps = runs[name]
            calls.assign(0)
            moved.assign(0)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                step()
            # The counters' reads wait for the steps' last ops.
            counted = int(calls.numpy()), int(moved.numpy())
            records[name]["cpu_s"].append(time.process_time() - c0)
            records[name]["wall_s"].append(time.perf_counter() - w0)
            records[name]["all_reduces"].append(counted[0] / local_replicas)
            records[name]["bytes"].append(counted[1] / local_replicas)
    params = sum(int(np.prod(v.shape)) * 4 for v in bench.make_model("mlp").trainable_variables)
    return {"records": records, "errors": errors, "replicas": replicas, "param_bytes": params}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return process_env(CUDA_VISIBLE_DEVICES="", **(extra or {}))


def run_mirrored(rounds: int, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", "mirrored", "--rounds", str(rounds)],
        env=_env(), capture_output=True, text=True, timeout=timeout, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_multi_worker(rounds: int, timeout: float) -> dict:
    ports = free_loopback_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "worker", "--rounds", str(rounds)],
            env=_env({"TF_CONFIG": tf_config}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(stderr[-4000:])
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs[0]  # the chief's; both workers run the same schedule


def summarize(result: dict) -> dict:
    records = result["records"]
    base = records["plain B"]
    out = {}
    for name, rec in records.items():
        row = {
            "all_reduces_per_cycle": float(np.median(rec["all_reduces"])),
            "mb_per_cycle": float(np.median(rec["bytes"])) / 1e6,
            "cpu_ms_per_micro_step": 1000 * float(np.median(rec["cpu_s"])) / N,
            "wall_ms_per_micro_step": 1000 * float(np.median(rec["wall_s"])) / N,
        }
        for key in ("cpu_s", "wall_s"):
            ratios = np.array(rec[key]) / np.array(base[key])
            row[f"{key[:-2]}_ratio"] = float(np.median(ratios))
            row[f"{key[:-2]}_ratio_ci"] = list(bench._bootstrap_ci([ratios], bench._median))
        out[name] = row
    return out


def report(results: dict, print_fn=print) -> None:
    for kind, result in results.items():
        title = {"mirrored": "MirroredStrategy, 2 logical CPU devices, one process",
                 "multi_worker": "MultiWorkerMirroredStrategy, 2 workers on loopback"}[kind]
        rounds = len(next(iter(result["records"].values()))["cpu_s"])
        print_fn(f"\n### {title} ({rounds} rounds)\n")
        print_fn(f"Gradients: {result['param_bytes'] / 1e6:.1f} MB per replica. "
                 f"Per cycle of n={N} micro-steps of B={B} per replica; ratios to plain B, "
                 "median [95% interval].\n")
        print_fn("| variant | all-reduces per cycle | MB reduced per cycle | CPU per micro-step | "
                 "wall per micro-step | CPU ratio | wall ratio |")
        print_fn("|---|---|---|---|---|---|---|")
        for name, row in summarize(result).items():
            ci_c, ci_w = row["cpu_ratio_ci"], row["wall_ratio_ci"]
            print_fn(f"| {name} | {row['all_reduces_per_cycle']:g} | {row['mb_per_cycle']:.1f} | "
                     f"{row['cpu_ms_per_micro_step']:.1f} ms | {row['wall_ms_per_micro_step']:.1f} ms | "
                     f"{row['cpu_ratio']:.3f} [{ci_c[0]:.3f}-{ci_c[1]:.3f}] | "
                     f"{row['wall_ratio']:.3f} [{ci_w[0]:.3f}-{ci_w[1]:.3f}] |")
        for name, error in result["errors"].items():
            print_fn(f"\n{name}: fails: `{error}`")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--only", nargs="*", choices=["mirrored", "multi_worker"])
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--child", choices=["mirrored", "worker"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.rounds)))
        return
    results = {}
    for kind in args.only or ["mirrored", "multi_worker"]:
        print(f"  {kind} ({args.rounds} rounds) ...", flush=True)
        run = run_mirrored if kind == "mirrored" else run_multi_worker
        results[kind] = run(args.rounds, args.timeout)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
