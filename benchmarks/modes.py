"""Which mode when: time per micro-step against the micro-batch size, drawn.

    pip install ".[bench]"
    python benchmarks/modes.py                 # the sweep and the plot (~25 minutes)
    python benchmarks/modes.py --rounds 5      # smoke run
    python benchmarks/modes.py --replot modes.json

For the benchmark's MLP (4.2M parameters; optimizer-heavy at small
micro-batches, compute-heavy at large ones) with Adam and with SGD, under
`tf.function` (graph) and XLA, and micro-batch sizes from 2 to 256: the
CPU time per micro-step of masked mode, skip mode and Keras's own
`gradient_accumulation_steps`, relative to the plain optimizer at the same
micro-batch size (n = 4). Each point is measured as in `bench.py` (all
variants in one process, one cycle per `fit`, the order rotated every
round, the median of per-round ratios) and drawn with its 95% interval.
The plot is written to `benchmarks/modes.png`, the figures to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402

BATCHES = [2, 8, 32, 128, 256]
OPTIMIZERS = ["adam", "sgd"]
COMPILERS = ["graph", "jit"]
SHOWN = ["masked", "skip", "keras"]
LABELS = {"masked": "gradaccum masked (default)", "skip": "gradaccum skip",
          "keras": "Keras gradient_accumulation_steps"}


def sweep(rounds: int, log) -> dict:
    out: dict = {}
    for opt_name in OPTIMIZERS:
        for compiler in COMPILERS:
            for batch in BATCHES:
                key = f"mlp/{opt_name}/B={batch}/{compiler}"
                log(f"  {key} ", end="")
                res = bench.time_case(
                    "mlp", opt_name, batch, compiler == "jit", bench.N, rounds, log,
                    copies=1, names=["plain B", "plain B (A/A)", *SHOWN],
                )
                res.pop("_rounds")
                out[key] = res
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPTIMIZERS) * len(COMPILERS), figsize=(16, 4.2), sharey=True)
    panels = [(o, c) for o in OPTIMIZERS for c in COMPILERS]
    for ax, (opt_name, compiler) in zip(axes, panels):
        batches = [b for b in BATCHES if f"mlp/{opt_name}/B={b}/{compiler}" in results]
        for name in ["plain B (A/A)", *SHOWN]:
            rows = [results[f"mlp/{opt_name}/B={b}/{compiler}"][name] for b in batches]
            y = [r["cpu_ratio"] for r in rows]
            lo = [r["cpu_ratio"] - r["cpu_ratio_ci"][0] for r in rows]
            hi = [r["cpu_ratio_ci"][1] - r["cpu_ratio"] for r in rows]
            style = {"linestyle": ":", "color": "gray"} if name == "plain B (A/A)" else {}
            ax.errorbar(batches, y, yerr=[lo, hi], marker="o", capsize=3,
                        label=LABELS.get(name, "plain, second copy (noise)"), **style)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"MLP 4.2M, {'Adam' if opt_name == 'adam' else 'SGD'}, "
                     f"{'XLA' if compiler == 'jit' else 'graph'}")
        ax.set_xlabel("micro-batch size B (n = 4)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("CPU time per micro-step / plain at B")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--replot", help="draw from a JSON file written by --json; measure nothing")
    p.add_argument("--out", default=os.path.join(HERE, "modes.png"))
    args = p.parse_args(argv)

    def log(*a, **k):
        print(*a, **k, flush=True)

    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
    else:
        results = sweep(args.rounds, log)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    for key, res in results.items():
        log(key, "  ".join(f"{name} {res[name]['cpu_ratio']:.3f}" for name in SHOWN))
    plot(results, args.out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
