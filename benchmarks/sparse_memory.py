"""What each `sparse` setting holds for slices, against the large batch's own gradient.

A BERT-like input layer: a word embedding (`--vocab` x `--dim`), a segment
embedding (2 x `--dim`, its all-zero ids one row repeated over every token:
slices that grow with the batch although every micro-step's ids are alike)
and a position embedding (`--length` x `--dim`, `Embedding(L)(arange(L))`
added to every sample: one slice per position, summed over the batch),
under a Dense head; micro-batches of `--batch` sequences of `--length`
tokens, `n=--n`, Adam, `model.fit`.

For each setting the script reports, per embedding:

- **held for slices**: the bytes of the buffers that keep the cycle's
  slices (values, int64 indices and the row count, as allocated: grown
  buffers are allocated for a whole cycle when the step is traced), read
  after `n - 1` micro-steps (the most a cycle holds before its update);
- **large batch's gradient**: the bytes of the `tf.IndexedSlices` that
  Keras's large batch (`n * batch` sequences) hands the optimizer for that
  embedding (values and int64 indices), measured with a `GradientTape`;

and the dense accumulators (allocated for every variable in each setting;
zero for a variable whose slices are kept), and CPU seconds per micro-step
in `fit` over `--cycles` cycles, after one cycle to trace.

    python benchmarks/sparse_memory.py                 # defaults: BERT-base widths
    python benchmarks/sparse_memory.py --dim 16 --vocab 1000 --length 16
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from gradaccum import accumulate  # noqa: E402

EMBEDDINGS = ("words", "segments", "positions")


class Positions(keras.layers.Layer):
    """Adds `Embedding(length)(arange(length))` to every sample."""

    def __init__(self, length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.table = keras.layers.Embedding(length, dim, name="positions")

    def build(self, input_shape):
        self.table.build((self.length,))

    def call(self, h):
        return h + self.table(ops.arange(self.length))


def model(vocab: int, dim: int, length: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    segments = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="words")(tokens)
    h = h + keras.layers.Embedding(2, dim, name="segments")(segments)
    h = Positions(length, dim, name="position_layer")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model([tokens, segments], keras.layers.Dense(2, name="out")(h))


def _embedding(path: str) -> str:
    return next(name for name in EMBEDDINGS if f"{name}/" in path)


def held_for_slices(opt) -> dict[str, int]:
    """Bytes allocated for each embedding's kept slices."""
    state = opt._self_core.state
    held = dict.fromkeys(EMBEDDINGS, 0)
    for i, kept in state.kept.items():
        held[_embedding(state.variables[i].path)] += sum(p.allocated_bytes() for p in kept.parts.values())
    return held


def dense_bytes(opt) -> int:
    return sum(int(np.asarray(a.numpy()).nbytes) for a in opt.accumulation_state.accumulators)


def large_batch_gradient(args: argparse.Namespace, x: list[np.ndarray], y: np.ndarray) -> dict[str, int]:
    """Bytes of the `tf.IndexedSlices` the large batch hands the optimizer."""
    m = model(args.vocab, args.dim, args.length)
    size = args.batch * args.n
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y[:size], m([a[:size] for a in x]))
    out = {}
    for v, g in zip(m.trainable_variables, tape.gradient(loss, m.trainable_variables)):
        if isinstance(g, tf.IndexedSlices):
            out[_embedding(v.path)] = int(tf.size(g.values)) * g.values.dtype.size + int(tf.size(g.indices)) * 8
    return out


def run(args: argparse.Namespace, sparse: str, x: list[np.ndarray], y: np.ndarray) -> dict:
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
    return {"held": held_for_slices(opt), "dense": dense_bytes(opt), "seconds": seconds}


def _size(value: int) -> str:
    """Bytes, exactly, and in MiB."""
    return f"{value:,} B ({value / 2**20:.2f} MiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    samples = args.batch * args.n * (args.cycles + 1)
    x = [
        rng.integers(0, args.vocab, size=(samples, args.length)).astype("int32"),
        np.zeros((samples, args.length), "int32"),
    ]
    y = rng.integers(0, 2, size=samples).astype("int32")
    large = large_batch_gradient(args, x, y)
    print(
        f"vocab={args.vocab} dim={args.dim} batch={args.batch} length={args.length} n={args.n}; "
        "held for slices / the large batch's own gradient, per embedding"
    )
    print("| sparse | words | segments | positions | dense accumulators | CPU s / micro-step |")
    print("|---|---|---|---|---|---|")
    for sparse in ("rows", "slices", "auto"):
        r = run(args, sparse, x, y)
        cells = [f"{_size(r['held'][e])} / {_size(large[e])}" for e in EMBEDDINGS]
        print(f"| {sparse} | {' | '.join(cells)} | {_size(r['dense'])} | {r['seconds']:.4f} |")


if __name__ == "__main__":
    main()
