"""What `sparse="slices"` holds, against the default `sparse="rows"`.

A BERT-like input layer: a word embedding (`--vocab` x `--dim`) and a
segment embedding (2 x `--dim`, one row repeated over every token), under a
Dense head; micro-batches of `--batch` sequences of `--length` tokens,
`n=--n`, Adam, `model.fit`. After `n - 1` micro-steps (the most a cycle holds
before its update) the script sums the bytes of the accumulation state's
variables (`opt.accumulation_state`): the dense accumulators, and with
`"slices"` the kept values and indices. It also times a micro-step in `fit`
(CPU seconds per micro-step over `--cycles` cycles, after one cycle to trace).

    python benchmarks/sparse_memory.py                 # defaults: BERT-base-like widths
    python benchmarks/sparse_memory.py --dim 16 --vocab 1000 --length 16

Each kept slice is one row of values (`dim` float32) and one int64 index, for
every token of every micro-batch of the cycle: `n * batch * length * (4 * dim
+ 8)` bytes per embedding at the end of a cycle, whatever the vocabulary. The
dense accumulator of an embedding (`vocab * dim` float32) is allocated in
either setting; with `"slices"` it stays zero.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from gradaccum import accumulate  # noqa: E402


def model(vocab: int, dim: int, length: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    segments = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="words")(tokens)
    h = h + keras.layers.Embedding(2, dim, name="segments")(segments)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model([tokens, segments], keras.layers.Dense(2, name="out")(h))


def held_bytes(opt) -> dict[str, int]:
    state = opt.accumulation_state
    dense = sum(int(np.asarray(a.numpy()).nbytes) for a in state.accumulators)
    kept = sum(
        int(np.asarray(values.numpy()).nbytes) + int(np.asarray(indices.numpy()).nbytes)
        for values, indices in state.kept_slices.values()
    )
    return {"dense": dense, "kept": kept}


def run(args: argparse.Namespace, sparse: str) -> dict[str, float]:
    rng = np.random.default_rng(0)
    samples = args.batch * args.n * (args.cycles + 1)
    x = [
        rng.integers(0, args.vocab, size=(samples, args.length)).astype("int32"),
        np.zeros((samples, args.length), "int32"),
    ]
    y = rng.integers(0, 2, size=samples).astype("int32")
    m = model(args.vocab, args.dim, args.length)
    opt = accumulate(keras.optimizers.Adam(1e-3), args.n, sparse=sparse)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cycle = args.batch * args.n
    m.fit([a[:cycle] for a in x], y[:cycle], batch_size=args.batch, shuffle=False, verbose=0)
    start = time.process_time()
    m.fit([a[cycle:] for a in x], y[cycle:], batch_size=args.batch, shuffle=False, verbose=0)
    seconds = (time.process_time() - start) / (args.n * args.cycles)
    last = cycle + (args.n - 1) * args.batch
    m.fit([a[cycle:last] for a in x], y[cycle:last], batch_size=args.batch, shuffle=False, verbose=0)
    held = held_bytes(opt)
    return {**held, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    params = (args.vocab + 2) * args.dim * 4
    print(
        f"vocab={args.vocab} dim={args.dim} batch={args.batch} length={args.length} "
        f"n={args.n}: embedding parameters {params / 2**20:.2f} MiB"
    )
    print("| sparse | dense accumulators | kept slices | total held | CPU s / micro-step |")
    print("|---|---|---|---|---|")
    for sparse in ("rows", "slices"):
        r = run(args, sparse)
        print(
            f"| {sparse} | {r['dense'] / 2**20:.2f} MiB | {r['kept'] / 2**20:.2f} MiB | "
            f"{(r['dense'] + r['kept']) / 2**20:.2f} MiB | {r['seconds']:.4f} |"
        )


if __name__ == "__main__":
    main()
