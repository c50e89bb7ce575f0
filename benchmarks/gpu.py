"""gradaccum on a GPU: a transformer language model on JAX and PyTorch.

    python benchmarks/gpu.py                          # every backend with a CUDA device
    python benchmarks/gpu.py --backends torch --rounds 5
    python benchmarks/gpu.py --allow-cpu --tiny       # a smoke run on the CPU

A causal transformer LM (token and position embeddings, `--layers` blocks of
`--d-model` with `--heads` heads, a vocabulary of `--vocab`, sequences of
`--seq`; padding tokens masked out of the loss) trains under `mixed_bfloat16`
with each variant:

- `plain large`: the plain optimizer (AdamW) on the large batch, `n * B`;
- `plain micro`: the plain optimizer on the micro-batches, `B` (the cost of
  the same samples without accumulation);
- `masked`, `skip`: `accumulate(AdamW, n, mode=...)` on micro-batches;
- `keras`: Keras's own `gradient_accumulation_steps=n` on micro-batches.

Time: each variant runs in a fresh process per round, the variants in an
order rotated from round to round (one GPU machine was measured up to 15%
apart between runs); a process warms up (compiles), then times `--cycles`
cycles of `fit` and reports microseconds per sample. Memory: the peak device
memory of that process (JAX's `memory_stats()["peak_bytes_in_use"]`,
`torch.cuda.max_memory_allocated()`), and its extra over `plain micro` in
multiples of the parameter bytes. The table gives medians over rounds with
their spread (min-max).

Equivalence: in float32 (TF32 off: `torch.backends.cuda.matmul.allow_tf32`
and `jax_default_matmul_precision="highest"`), a few cycles of each
accumulating variant against the large batch from the same initial weights,
as the largest difference of the final weights over the weights' largest
movement (the large batch's own run-to-run noise is about 1e-4 of it).

Nothing here runs in the tests or in CI: it needs a GPU for its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("plain large", "plain micro", "masked", "skip", "keras")


def build_model(args: argparse.Namespace):
    import keras

    class Positions(keras.layers.Layer):
        """Adds a learned embedding of each position."""

        def __init__(self, length: int, dim: int, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True
            self.table = self.add_weight(shape=(length, dim), initializer="random_normal", name="table")

        def call(self, x):
            return x + keras.ops.cast(self.table, x.dtype)[None]

    keras.utils.set_random_seed(0)
    tokens = keras.Input((args.seq,), dtype="int32")
    embedded = keras.layers.Embedding(args.vocab, args.d_model, mask_zero=True, name="tokens")(tokens)
    h = Positions(args.seq, args.d_model, name="positions")(embedded)
    for i in range(args.layers):
        a = keras.layers.LayerNormalization(name=f"ln_a{i}")(h)
        a = keras.layers.MultiHeadAttention(args.heads, args.d_model // args.heads, name=f"attention{i}")(
            a, a, use_causal_mask=True
        )
        # Layers, not `+`: they carry the padding mask on to the loss.
        h = keras.layers.Add()([h, a])
        f = keras.layers.LayerNormalization(name=f"ln_f{i}")(h)
        f = keras.layers.Dense(4 * args.d_model, activation="gelu", name=f"up{i}")(f)
        h = keras.layers.Add()([h, keras.layers.Dense(args.d_model, name=f"down{i}")(f)])
    logits = keras.layers.Dense(args.vocab, name="logits", dtype="float32")(keras.layers.LayerNormalization()(h))
    return keras.Model(tokens, logits)


def make_data(args: argparse.Namespace, samples: int):
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.integers(1, args.vocab, size=(samples, args.seq)).astype("int32")
    lengths = rng.integers(args.seq // 4, args.seq + 1, size=samples)
    x[np.arange(args.seq)[None, :] >= lengths[:, None]] = 0  # padding, masked out
    y = np.roll(x, -1, axis=1)
    return x, y


def make_optimizer(variant: str, n: int):
    import keras

    from gradaccum import accumulate

    adamw = lambda **kw: keras.optimizers.AdamW(1e-4, weight_decay=0.01, **kw)  # noqa: E731
    if variant in ("plain large", "plain micro"):
        return adamw()
    if variant == "keras":
        return adamw(gradient_accumulation_steps=n)
    return accumulate(adamw(), n, mode=variant)


def child(args: argparse.Namespace) -> dict:
    """One variant in this process: time, peak memory, or final weights."""
    import keras
    import numpy as np

    backend = keras.config.backend()
    if args.equivalence:
        if backend == "torch":
            import torch

            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        else:
            import jax

            jax.config.update("jax_default_matmul_precision", "highest")
    else:
        keras.config.set_dtype_policy("mixed_bfloat16")
    micro = args.micro_batch
    batch = micro * args.n if args.variant == "plain large" else micro
    model = build_model(args)
    start = [np.array(keras.ops.convert_to_numpy(w)) for w in model.trainable_weights]
    model.compile(
        optimizer=make_optimizer(args.variant, args.n),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=backend == "jax",
    )
    params = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    samples = micro * args.n * args.cycles
    x, y = make_data(args, samples)
    if args.equivalence:
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        end = [np.array(keras.ops.convert_to_numpy(w)) for w in model.trainable_weights]
        # A file, not JSON: the weights are tens of millions of numbers.
        path = os.path.join(tempfile.mkdtemp(), "weights.npz")
        np.savez(path, *start, *end)
        return {"weights": path, "count": len(start)}
    model.fit(x[: micro * args.n * 2], y[: micro * args.n * 2], batch_size=batch, shuffle=False, verbose=0)
    _reset_peak(backend)
    _sync(backend, model)
    begin = time.perf_counter()
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    _sync(backend, model)
    elapsed = time.perf_counter() - begin
    return {"us_per_sample": 1e6 * elapsed / samples, "peak": _peak(backend), "params": params}


def _sync(backend: str, model) -> None:
    import keras

    keras.ops.convert_to_numpy(model.trainable_weights[0])  # waits for the device
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _reset_peak(backend: str) -> None:
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def _peak(backend: str) -> float | None:
    if backend == "torch":
        import torch

        return float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return float(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def _run_child(backend: str, variant: str, args: argparse.Namespace, equivalence: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", variant, *_model_flags(args)]
    if equivalence:
        command.append("--equivalence")
    env = dict(os.environ, KERAS_BACKEND=backend)
    if backend == "jax":
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peaks, not the pool
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{backend}/{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _model_flags(args: argparse.Namespace) -> list[str]:
    names = ("layers", "d_model", "heads", "seq", "vocab", "micro_batch", "n", "cycles")
    return [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]


def _has_cuda(backend: str) -> bool:
    probe = {
        "torch": "import torch; print(torch.cuda.is_available())",
        "jax": "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))",
    }[backend]
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.strip().endswith("True")


def report(backend: str, args: argparse.Namespace) -> None:
    import numpy as np

    # Equivalence first: it is the figure a run cut short must not lose.
    print(f"\n{backend}: equivalence in float32 (largest weight difference / "
          "largest weight movement of the large batch):", flush=True)

    def weights(variant: str) -> tuple[list, list]:
        done = _run_child(backend, variant, args, equivalence=True)
        with np.load(done["weights"]) as saved:
            arrays = [saved[f"arr_{i}"] for i in range(2 * done["count"])]
        return arrays[: done["count"]], arrays[done["count"]:]

    start, end = weights("plain large")
    movement = max(float(np.max(np.abs(e - s))) for e, s in zip(end, start))
    for variant in ("masked", "skip", "keras"):
        other = weights(variant)[1]
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(other, end))
        print(f"  {variant}: {difference / movement:.2e}", flush=True)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            result = _run_child(backend, variant, args)
            results[variant].append(result)
            # As it comes: a run cut short still leaves its figures.
            peak = "n/a" if result["peak"] is None else f"{result['peak'] / 2**20:.0f} MiB"
            print(f"  {backend} round {r} {variant}: {result['us_per_sample']:.0f} us/sample, peak {peak}",
                  flush=True)
    params = results["plain micro"][0]["params"]
    base_peak = statistics.median(x["peak"] or 0 for x in results["plain micro"])
    print(f"\n{backend}: {args.layers} blocks, d={args.d_model}, {params / 4 / 1e6:.1f}M parameters, "
          f"B={args.micro_batch}, n={args.n}, {args.rounds} rounds")
    print("| variant | us per sample, median [min-max] | / plain micro | / keras | peak MiB | extra (x params) |")
    print("|---|---|---|---|---|---|")
    median = {v: statistics.median(x["us_per_sample"] for x in results[v]) for v in VARIANTS}
    for variant in VARIANTS:
        times = [x["us_per_sample"] for x in results[variant]]
        peaks = [x["peak"] for x in results[variant] if x["peak"] is not None]
        peak = statistics.median(peaks) if peaks else None
        extra = "n/a" if peak is None else f"{(peak - base_peak) / params:.2f}"
        print(f"| {variant} | {median[variant]:.0f} [{min(times):.0f}-{max(times):.0f}] | "
              f"{median[variant] / median['plain micro']:.3f} | {median[variant] / median['keras']:.3f} | "
              f"{'n/a' if peak is None else f'{peak / 2**20:.0f}'} | {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    parser.add_argument("--tiny", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--allow-cpu", action="store_true", help="run where no CUDA device exists")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--equivalence", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.d_model, args.heads, args.seq, args.vocab = 1, 32, 2, 16, 64
        args.micro_batch, args.n, args.cycles = 4, 2, 2
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return
    for backend in args.backends:
        if not args.allow_cpu and not _has_cuda(backend):
            print(f"{backend}: no CUDA device; skipped (--allow-cpu runs it anyway)")
            continue
        report(backend, args)


if __name__ == "__main__":
    main()
