"""Kernel time and kernel count per micro-step, by operation, for variants of a timing case.

    python benchmarks/op_profile.py                          # skip vs Keras's option, MLP SGD B=8
    python benchmarks/op_profile.py --variants masked "plain B" --optimizer adam
    python benchmarks/op_profile.py --threads                # CPU time by thread instead

`bench.py` says how much slower one variant is; this says where. Each variant
(a model and optimizer from `bench.variants`, same initial weights, compiled
and warmed up in one process) runs `--cycles` one-cycle `fit` calls under
`tf.profiler`, in `--blocks` blocks that alternate between the variants. The
host trace is read back (`.xplane.pb`) and every kernel event is summed by
operation type and place in the graph, with trailing numbers and layer names
removed so that the variants' rows line up. The table gives microseconds of
kernel time per micro-step and kernels run per micro-step; a kernel running
in a branch not taken is not counted. The profiler's own cost per event makes
the process slower, and more so the more kernels a step runs, so compare the
kernel rows, not the total.

With `--threads`, nothing is profiled: the CPU time of each thread of the
process (`/proc/self/task`) is summed over the same alternating blocks, by
thread name and id, which tells work on the calling thread from work on
TensorFlow's thread pools.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import bench  # noqa: E402


def build(names: list[str], model_kind: str, opt_name: str, batch: int) -> dict:
    """One warmed-up (model, dataset) per variant name."""
    import tensorflow as tf

    x, y = bench.make_data(model_kind, batch * bench.N)
    made = bench.variants(opt_name)
    unknown = [n for n in names if n not in made]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; expected some of {list(made)}")
    runs = {}
    for name in names:
        make_opt, factor = made[name]
        model = bench.make_model(model_kind)
        model.compile(optimizer=make_opt(), loss="mse", jit_compile=False)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * factor).cache()
        for _ in range(3):
            model.fit(ds, epochs=1, verbose=0)
        runs[name] = (model, ds)
    return runs


def _row_name(name: str) -> str | None:
    """`type @ place` for a kernel event (`place/in/graph:Type`), else None."""
    if ":" not in name or "/" not in name:
        return None
    place, kind = name.rsplit(":", 1)
    place = place.replace("StatefulPartitionedCall/", "")
    place = re.sub(r"_\d+", "", place)  # layer and branch numbers differ per variant
    place = re.sub(r"(mlp|conv)/\w+?/", r"\1/layer/", place)
    return f"{kind} @ {place[-60:]}"


def kernels(runs: dict, cycles: int, blocks: int) -> tuple[dict, dict]:
    """Kernel microseconds and counts per row, summed per variant."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    spent = {n: collections.Counter() for n in runs}
    counts = {n: collections.Counter() for n in runs}
    names = list(runs)
    with tempfile.TemporaryDirectory() as tmp:
        for b in range(blocks):
            for name in names if b % 2 == 0 else names[::-1]:
                model, ds = runs[name]
                logdir = os.path.join(tmp, "trace")
                shutil.rmtree(logdir, ignore_errors=True)
                options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0)
                tf.profiler.experimental.start(logdir, options=options)
                for _ in range(cycles):
                    model.fit(ds, epochs=1, verbose=0)
                tf.profiler.experimental.stop()
                space = xplane_pb2.XSpace()
                with open(glob.glob(logdir + "/**/*.xplane.pb", recursive=True)[0], "rb") as f:
                    space.ParseFromString(f.read())
                for plane in space.planes:
                    if plane.name != "/host:CPU":
                        continue
                    for line in plane.lines:
                        for event in line.events:
                            row = _row_name(plane.event_metadata[event.metadata_id].name)
                            if row is not None:
                                spent[name][row] += event.duration_ps / 1e6
                                counts[name][row] += 1
    return spent, counts


def thread_times(runs: dict, cycles: int, blocks: int) -> dict:
    """CPU seconds per thread (name:id), summed per variant."""
    tick = os.sysconf("SC_CLK_TCK")

    def snapshot() -> dict:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            out[f"{comm}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
        return out

    spent = {n: collections.Counter() for n in runs}
    names = list(runs)
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            model, ds = runs[name]
            before = snapshot()
            for _ in range(cycles):
                model.fit(ds, epochs=1, verbose=0)
            for thread, seconds in snapshot().items():
                spent[name][thread] += seconds - before.get(thread, 0.0)
    return spent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["skip", "keras"],
                        help="names from bench.variants (default: skip keras)")
    parser.add_argument("--model", choices=["mlp", "conv"], default="mlp")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="sgd")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=30, help="one-cycle fits per block")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=40, help="kernel rows shown")
    parser.add_argument("--threads", action="store_true", help="CPU time by thread, not kernels")
    args = parser.parse_args(argv)
    for flag in ("batch", "cycles", "blocks", "rows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")

    runs = build(args.variants, args.model, args.optimizer, args.batch)
    names = list(runs)
    steps = args.cycles * args.blocks * bench.N
    header = " ".join(f"{n[:14]:>14s}" for n in names)
    if args.threads:
        spent = thread_times(runs, args.cycles, args.blocks)
        threads = sorted(set().union(*spent.values()), key=lambda t: -max(s[t] for s in spent.values()))
        print(f"CPU microseconds per micro-step, by thread ({steps} micro-steps each)")
        print(f"{'thread':30s} {header}")
        for t in threads:
            if max(s[t] for s in spent.values()) * 1e6 / steps >= 1:
                print(f"{t:30s} " + " ".join(f"{spent[n][t] * 1e6 / steps:14.1f}" for n in names))
        print(f"{'total':30s} " + " ".join(f"{sum(spent[n].values()) * 1e6 / steps:14.1f}" for n in names))
        return
    spent, counts = kernels(runs, args.cycles, args.blocks)
    print(f"Kernel microseconds per micro-step / kernels per micro-step ({steps} micro-steps each)")
    for n in names:
        print(f"  {n}: {sum(spent[n].values()) / steps:.1f} us in {sum(counts[n].values()) / steps:.1f} kernels")
    rows = sorted(set().union(*spent.values()), key=lambda r: -max(s[r] for s in spent.values()))
    print(f"{'operation @ place':72s} {header}")
    for r in rows[: args.rows]:
        cells = " ".join(f"{spent[n][r] / steps:8.1f}/{counts[n][r] / steps:5.2f}" for n in names)
        print(f"{r[:72]:72s} {cells}")


if __name__ == "__main__":
    main()
