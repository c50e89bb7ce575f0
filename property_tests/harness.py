"""Models, data and training runs shared by the property tests.

A `Case` describes one drawn training run: the model, the optimizer and its
hyperparameters, `n`, `reduction`, the micro-batch size, how many cycles,
which output heads contribute to the loss on each micro-step (a head left
out gives its variables `None` gradients), and the execution mode.

`run_subject` trains `accumulate(optimizer, n)` on micro-batches of size B
and checks, after every micro-step, that an in-between step left every model
and optimizer variable bit-identical and that `micro_step`/`iterations`
count as they should. `run_reference` trains the plain optimizer on the
large batch of B*n samples of each cycle, from the same initial weights and
in the same data order. Their final states must agree to float32 rounding
(`assert_matches_large_batch`). `run_summed` applies the plain optimizer to
the test's own float32 sum of the micro-batch gradients: mathematically the
large batch again, rounded as accumulation rounds; `run_plain_micro` is the
plain optimizer on the micro-batches (what n=1 must be, bit for bit).

Tracing dominates the cost, so models are built once per shape and reset by
assigning their saved initial weights; the optimizers are new per run (their
traced update is cheap next to a model build).

The runs work on every Keras backend: on TensorFlow in the execution modes
"eager", "tf_function" and "jit"; on JAX and PyTorch eagerly, with gradients
taken the backend's way (`tests.helpers.gradients_of`). State capture,
comparison and tolerances are the test suite's (`tests.helpers`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from hypothesis import settings

from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    assert_states_close,
    assert_states_equal,
    core_of,
    full_state,
    gradients_of,
    model_state,
    rounding_floor,
)

if BACKEND == "tensorflow":
    import tensorflow as tf

HEADS = 2
IN_DIM = 5
OUT_DIM = 2
VOCAB = 50
IDS_PER_SAMPLE = 3

def scaled(ci_examples: int) -> settings:
    """Settings with `ci_examples` under the ci profile, scaled for others."""
    factor = settings.default.max_examples / 10
    return settings(max_examples=max(1, round(ci_examples * factor)))


# ----------------------------------------------------------------------
# Models: a trunk and HEADS output heads, so that leaving a head out of the
# loss gives its variables `None` gradients.


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    kind: str  # "dense", "conv", "embedding" or "multi_input"
    width: int
    depth: int = 1

    def inputs(self, rng: np.random.Generator, cycle_samples: Sequence[int],
               unique_ids: bool) -> list[np.ndarray]:
        """Input arrays (one per model input) for cycles of these sizes."""
        samples = sum(cycle_samples)
        if self.kind == "dense":
            return [rng.normal(size=(samples, IN_DIM)).astype("float32")]
        if self.kind == "conv":
            return [rng.normal(size=(samples, 5, 5, 1)).astype("float32")]
        if self.kind == "multi_input":
            return [
                rng.normal(size=(samples, 4)).astype("float32"),
                rng.normal(size=(samples, 3)).astype("float32"),
            ]
        if unique_ids:
            # Every embedding row occurs at most once per cycle (see
            # `Case.unique_ids`).
            ids = np.concatenate(
                [rng.permutation(VOCAB)[: k * IDS_PER_SAMPLE] for k in cycle_samples]
            )
        else:
            ids = rng.integers(0, 8, size=samples * IDS_PER_SAMPLE)
        return [ids.reshape(samples, IDS_PER_SAMPLE).astype("int32")]


def _build(spec: ModelSpec) -> keras.Model:
    keras.utils.set_random_seed(1234)
    if spec.kind == "dense":
        inputs = [keras.Input((IN_DIM,), name="x")]
        h = inputs[0]
        for i in range(spec.depth):
            h = keras.layers.Dense(spec.width, activation="tanh", name=f"trunk{i}")(h)
    elif spec.kind == "conv":
        inputs = [keras.Input((5, 5, 1), name="x")]
        h = keras.layers.Conv2D(spec.width, 3, activation="tanh", name="conv")(inputs[0])
        for i in range(1, spec.depth):
            h = keras.layers.Conv2D(spec.width, 2, activation="tanh", name=f"conv{i}")(h)
        h = keras.layers.Flatten()(h)
    elif spec.kind == "embedding":
        inputs = [keras.Input((IDS_PER_SAMPLE,), dtype="int32", name="ids")]
        h = keras.layers.Embedding(VOCAB, spec.width, name="emb")(inputs[0])
        h = keras.layers.Flatten()(h)
        for i in range(1, spec.depth):
            h = keras.layers.Dense(spec.width, activation="tanh", name=f"trunk{i}")(h)
    elif spec.kind == "multi_input":
        inputs = [keras.Input((4,), name="a"), keras.Input((3,), name="b")]
        a = keras.layers.Dense(spec.width, activation="tanh", name="branch_a")(inputs[0])
        b = keras.layers.Dense(spec.width, activation="tanh", name="branch_b")(inputs[1])
        h = keras.layers.Concatenate()([a, b])
        for i in range(1, spec.depth):
            h = keras.layers.Dense(spec.width, activation="tanh", name=f"trunk{i}")(h)
    else:
        raise ValueError(f"Unknown model kind {spec.kind!r}.")
    outputs = [keras.layers.Dense(OUT_DIM, name=f"head{k}")(h) for k in range(HEADS)]
    return keras.Model(inputs, outputs, name=spec.kind)


_MODELS: dict[tuple[ModelSpec, int], tuple[keras.Model, list[np.ndarray]]] = {}


def model_for(spec: ModelSpec, copy: int = 0) -> keras.Model:
    """Model `copy` of this shape (0 or 1), reset to its initial weights."""
    key = (spec, copy)
    if key not in _MODELS:
        model = _build(spec)
        _MODELS[key] = (model, [v.numpy() for v in model.weights])
    model, initial = _MODELS[key]
    for v, value in zip(model.weights, initial):
        v.assign(value)
    return model


# ----------------------------------------------------------------------
# Optimizers.


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class name, its keyword arguments and an LR schedule."""

    family: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    schedule: tuple[str, tuple[tuple[str, Any], ...]] | None = None
    # Where the class lives: "keras" (Keras 3), "tf_keras" (its optimizers
    # since Keras 2.11) or "tf_keras.legacy" (OptimizerV2).
    module: str = "keras"

    def make(self) -> Any:
        kwargs = dict(self.kwargs)
        optimizers = _optimizer_module(self.module)
        if self.schedule is not None:
            name, schedule_kwargs = self.schedule
            schedules = (keras if self.module == "keras" else _tf_keras()).optimizers.schedules
            kwargs["learning_rate"] = getattr(schedules, name)(**dict(schedule_kwargs))
        return getattr(optimizers, self.family)(**kwargs)

    def linear_in_gradient(self) -> bool:
        """Whether the update is linear in the gradient (rows may repeat)."""
        kwargs = dict(self.kwargs)
        clipped = any(
            kwargs.get(k) is not None for k in ("clipnorm", "clipvalue", "global_clipnorm")
        )
        return self.family == "SGD" and not clipped


def _tf_keras() -> Any:
    import tf_keras  # only in the tf_keras environment

    return tf_keras


def _optimizer_module(module: str) -> Any:
    if module == "keras":
        return keras.optimizers
    if module == "tf_keras":
        return _tf_keras().optimizers
    if module == "tf_keras.legacy":
        return _tf_keras().optimizers.legacy
    raise ValueError(f"Unknown optimizer module {module!r}.")


# ----------------------------------------------------------------------
# A drawn run.

# How a drawn run's steps execute (`Case.mode`): eagerly, in a
# `tf.function`, or one compiled by XLA; on JAX and PyTorch eagerly only.
EXECUTIONS = ("eager", "tf_function", "jit") if BACKEND == "tensorflow" else ("eager",)


@dataclasses.dataclass(frozen=True)
class Case:
    model: ModelSpec
    optimizer: OptimizerSpec
    n: int
    reduction: str
    micro_batch: int
    cycles: int
    # Micro-steps after the last full cycle (an unfinished cycle: nothing of
    # it may show in the state).
    extra: int
    # Per micro-step: the heads whose loss terms are included.
    heads: tuple[tuple[int, ...], ...]
    mode: str  # one of EXECUTIONS
    data_seed: int
    build_first: bool = True
    # None, or how a float32 LossScaleOptimizer is combined with the
    # accumulation: "accumulate_lso" = accumulate(LSO(opt), n),
    # "lso_accumulate" = LSO(accumulate(opt, n)). The reference is then
    # LSO(opt) on the large batch. Scales are powers of two, so in float32
    # unscaling is exact and the runs must agree as closely as without.
    loss_scale: str | None = None
    # None (every micro-batch has `micro_batch` samples), or per micro-step
    # sizes; then each micro-batch is passed with `weight=` its size, and the
    # weighted mean equals the large batch even for ragged micro-batches.
    sizes: tuple[int, ...] | None = None
    # `accumulate(..., mode=)`: "masked" (the update runs every micro-step,
    # masked) or "skip" (it runs on apply steps only).
    update: str = "masked"

    @property
    def micro_steps(self) -> int:
        return self.n * self.cycles + self.extra

    @property
    def weighted(self) -> bool:
        return self.sizes is not None

    def size(self, i: int) -> int:
        return self.micro_batch if self.sizes is None else self.sizes[i]

    def start(self, i: int) -> int:
        """Index of micro-step `i`'s first sample."""
        return sum(self.size(j) for j in range(i))

    def cycle_range(self, c: int) -> tuple[int, int]:
        return self.start(c * self.n), self.start((c + 1) * self.n)

    @property
    def unique_ids(self) -> bool:
        """Embedding rows unique within each cycle, unless the update is linear.

        Keras 3 squares the values of an `IndexedSlices` gradient before
        summing repeated rows, so for Adam-like optimizers (and clipping) a
        large-batch step depends on how often a row repeats in the batch,
        while the accumulated gradient holds the rows already summed. With
        rows unique within a cycle both see the same numbers. With n=1 there
        is nothing to accumulate, and rows repeat freely.
        """
        return self.n > 1 and not self.optimizer.linear_in_gradient()

    def data(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rng = np.random.default_rng(self.data_seed)
        cycles = [self.start(min((c + 1) * self.n, self.micro_steps)) - self.start(c * self.n)
                  for c in range(self.cycles + (self.extra > 0))]
        xs = self.model.inputs(rng, cycles, self.unique_ids)
        samples = sum(cycles)
        ys = [rng.normal(size=(samples, OUT_DIM)).astype("float32") for _ in range(HEADS)]
        return xs, ys


def _tensor(value: Any, dtype: str | None = None) -> Any:
    if BACKEND == "tensorflow":
        return tf.constant(value, dtype)
    return keras.ops.convert_to_tensor(value, dtype)


def _rows(arrays: Sequence[np.ndarray], start: int, stop: int) -> list[Any]:
    return [_tensor(a[start:stop]) for a in arrays]


def _per_sample_mse(out: Any, y: Any) -> Any:
    if BACKEND == "tensorflow":
        return tf.reduce_mean(tf.square(out - y), axis=-1)
    return keras.ops.mean(keras.ops.square(out - y), axis=-1)


def _mean(x: Any) -> Any:
    return tf.reduce_mean(x) if BACKEND == "tensorflow" else keras.ops.mean(x)


def _add_n(terms: list[Any]) -> Any:
    return tf.add_n(terms) if BACKEND == "tensorflow" else sum(terms[1:], terms[0])


def _compile(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    if mode == "eager":
        return fn
    if BACKEND != "tensorflow":
        raise ValueError(f"Mode {mode!r} is TensorFlow's; on {BACKEND} the runs are eager.")
    return tf.function(fn, jit_compile=(mode == "jit"))


def micro_step_fn(model: keras.Model, opt: Any, mode: str) -> Callable[..., Any]:
    """`step(xs, ys, heads, weight=None)`: one micro-batch, mean loss over `heads`."""

    def step(xs, ys, heads, weight=None):
        def loss_of(outs):
            return opt.scale_loss(_add_n([_mean(_per_sample_mse(outs[h], ys[h])) for h in heads]))

        grads = gradients_of(model, xs, loss_of)
        if weight is None:
            opt.apply_gradients(zip(grads, model.trainable_variables))
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)

    return _compile(step, mode)


def large_batch_fn(model: keras.Model, opt: Any, mode: str) -> Callable[..., Any]:
    """`step(xs, ys, weights, heads, scale)`: one large batch.

    The loss is `scale * sum_h mean_s(weights[h][s] * mse_h(s))` over the
    heads in `heads`; a weight is 1 where the micro-batch holding sample `s`
    included head `h`, else 0. With `scale=1` that is the mean of the
    micro-batch losses, i.e. the large-batch mean loss.
    """

    def step(xs, ys, weights, heads, scale):
        def loss_of(outs):
            loss = _add_n([_mean(weights[h] * _per_sample_mse(outs[h], ys[h])) for h in heads])
            return opt.scale_loss(loss * scale)

        grads = gradients_of(model, xs, loss_of)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return _compile(step, mode)


# ----------------------------------------------------------------------
# Comparison.


def assert_matches_large_batch(case: Case, reference: dict, subject: dict) -> None:
    """`subject` equals the large-batch `reference` to float32 rounding.

    Within `RTOL`/`ATOL`; only if that fails is the summed plain run made
    (`run_summed`), and entries may then differ by up to `FLOOR_FACTOR`
    times its distance from the reference (see `tests.helpers.rounding_floor`).
    A loss-scale optimizer's step counter counts finite loss-scaled backward
    passes, batches for the reference and micro-batches for the subject, and
    is checked on its own.
    """
    if case.loss_scale:
        reference, subject = dict(reference), dict(subject)
        assert int(reference.pop(STEP_COUNTER)) == case.cycles
        assert int(subject.pop(STEP_COUNTER)) == case.micro_steps
    try:
        assert_states_close(reference, subject)
    except AssertionError:
        summed, _, _ = run_summed(case)
        summed = {k: v for k, v in summed.items() if k in reference}
        assert_states_close(reference, subject, floor=rounding_floor(reference, summed))


# ----------------------------------------------------------------------
# Runs.

LSO = keras.optimizers.LossScaleOptimizer
# Counts finite loss-scaled backward passes: micro-batches for the
# accumulating runs, batches for the reference (documented), so it is
# compared on its own.
STEP_COUNTER = "opt/step_counter"


def make_plain(case: Case) -> Any:
    """The reference optimizer: the drawn one, loss-scaled if the case is."""
    opt = case.optimizer.make()
    return LSO(opt) if case.loss_scale else opt


def make_subject(case: Case, sparse: str = "auto") -> Any:
    """The accumulating optimizer for the case (see `Case.loss_scale`)."""
    inner = case.optimizer.make()
    kwargs = {"reduction": case.reduction, "mode": case.update, "sparse": sparse}
    if case.loss_scale == "accumulate_lso":
        return accumulate(LSO(inner), case.n, **kwargs)
    if case.loss_scale == "lso_accumulate":
        return LSO(accumulate(inner, case.n, **kwargs))
    return accumulate(inner, case.n, **kwargs)


def _checkpoint(model: keras.Model, opt: Any, directory: str) -> str:
    return tf.train.Checkpoint(model=model, optimizer=opt).write(
        os.path.join(directory, "ckpt")
    )


def run_subject(case: Case, resume_at: int | None = None, sparse: str = "auto"):
    """Trains the accumulating optimizer on micro-batches; checks each step.

    After every micro-step: `micro_step` and `iterations` count micro-batches
    and applied updates, and an in-between micro-step left every model weight
    and optimizer variable bit-identical (`np.array_equal`); the loss-scale
    step counter, which counts micro-batches, only advanced by one.

    Args:
        case: The drawn run.
        resume_at: If given, after this many micro-steps the model and
            optimizer are written to a `tf.train.Checkpoint`, restored into
            a second model and a freshly made optimizer, and training goes on
            with those (and a newly traced step).
        sparse: `accumulate`'s `sparse`.

    Returns:
        `(state, model, optimizer)` after `case.micro_steps` micro-steps.
    """
    xs, ys = case.data()
    model = model_for(case.model)
    opt = make_subject(case, sparse)
    if case.build_first:
        opt.build(model.trainable_variables)
    step = micro_step_fn(model, opt, case.mode)
    applied = 0
    with tempfile.TemporaryDirectory() as directory:
        for i in range(case.micro_steps):
            if i == resume_at:
                path = _checkpoint(model, opt, directory)
                model = model_for(case.model, copy=1)
                opt = make_subject(case, sparse)
                if case.build_first:
                    opt.build(model.trainable_variables)
                status = tf.train.Checkpoint(model=model, optimizer=opt).read(path)
                if not case.build_first:
                    opt.build(model.trainable_variables)  # deferred values land here
                status.assert_consumed()
                step = micro_step_fn(model, opt, case.mode)
            applies = (i + 1) % case.n == 0
            before = full_state(model, opt) if opt.built else model_state(model)
            lo, hi = case.start(i), case.start(i + 1)
            weight = _tensor(float(case.size(i))) if case.weighted else None
            step(_rows(xs, lo, hi), _rows(ys, lo, hi), case.heads[i], weight)
            applied += applies
            assert int(core_of(opt).micro_step) == (i + 1) % case.n, f"micro-step {i}"
            assert int(opt.iterations) == applied, f"micro-step {i}"
            if case.loss_scale:
                assert int(opt.step_counter.numpy()) == i + 1, f"micro-step {i}"
            if not applies:
                after = full_state(model, opt) if "iterations" in before else model_state(model)
                before.pop(STEP_COUNTER, None), after.pop(STEP_COUNTER, None)
                assert_states_equal(before, after, f"in-between micro-step {i}")
    return full_state(model, opt), model, opt


def run_reference(case: Case, scale: float | None = None):
    """Trains the plain optimizer on the large batch (B*n) of each cycle.

    A cycle's large-batch loss holds the heads that some micro-step of the
    cycle included (with zero weight on the samples of micro-steps that
    left them out): the accumulating optimizer's rule that a cycle's update
    takes the variables with a gradient in that cycle, and leaves a variable
    without one in the whole cycle alone, as the large batch does.

    Args:
        case: The drawn run.
        scale: Factor on the loss; default 1 for `reduction="mean"`, and for
            `"sum"` `n` (the sum of the n micro-batch mean losses), or with
            weighted micro-batches the cycle's sample count (their sum
            weighted by size).

    Returns:
        `(state, model, optimizer)` after `case.cycles` updates.
    """
    xs, ys = case.data()
    model = model_for(case.model)
    opt = make_plain(case)
    if case.build_first:
        opt.build(model.trainable_variables)
    n = case.n
    step = large_batch_fn(model, opt, case.mode)
    for c in range(case.cycles):
        sizes = [case.size(i) for i in range(c * n, (c + 1) * n)]
        cycle_heads = case.heads[c * n : (c + 1) * n]
        seen = set().union(*cycle_heads)
        weights = [
            _tensor(np.repeat([float(h in heads) for heads in cycle_heads], sizes), "float32")
            for h in range(HEADS)
        ]
        if scale is not None:
            factor = scale
        elif case.reduction == "mean":
            factor = 1.0
        else:  # the sum of the micro-batch losses, each weighted by its size
            factor = float(sum(sizes)) if case.weighted else float(n)
        lo, hi = case.cycle_range(c)
        step(_rows(xs, lo, hi), _rows(ys, lo, hi), weights, tuple(sorted(seen)),
             _tensor(factor, "float32"))
    return full_state(model, opt), model, opt


def run_summed(case: Case):
    """The plain optimizer on the mean of separately computed micro-gradients.

    Per cycle: the gradient of each micro-batch's loss (in the case's mode),
    summed in float32 in micro-step order (weighted by size for weighted
    runs), divided by n (or the total weight; not at all for `"sum"`), and
    applied once. Variables follow the same rule as `run_reference`: those
    with a gradient in the cycle, zeros on the micro-steps that gave none.

    Returns:
        `(state, model, optimizer)` after `case.cycles` updates.
    """
    xs, ys = case.data()
    model = model_for(case.model)
    opt = make_plain(case)
    # Built for every variable, as `apply_gradients` with `None` gradients
    # builds it (`apply` below gets the variables taking part only).
    opt.build(model.trainable_variables)
    variables = model.trainable_variables

    def grads_of(xb, yb, heads):
        def loss_of(outs):
            return opt.scale_loss(_add_n([_mean(_per_sample_mse(outs[h], yb[h])) for h in heads]))

        return gradients_of(model, xb, loss_of)

    def apply(grads, indices):
        opt.apply_gradients(zip(grads, [variables[i] for i in indices]))

    grads_of, apply = _compile(grads_of, case.mode), _compile(apply, case.mode)
    for c in range(case.cycles):
        sums: dict[int, Any] = {}
        total = _tensor(0.0)
        for i in range(c * case.n, (c + 1) * case.n):
            lo, hi = case.start(i), case.start(i + 1)
            w = _tensor(float(case.size(i))) if case.weighted else None
            for k, g in enumerate(grads_of(_rows(xs, lo, hi), _rows(ys, lo, hi), case.heads[i])):
                if g is None:
                    continue
                g = tf.convert_to_tensor(g) if BACKEND == "tensorflow" else g
                g = g if w is None else g * w
                sums[k] = g if k not in sums else sums[k] + g
            total = total + (_tensor(1.0) if w is None else w)
        included = sorted(sums)
        grads = [sums[k] for k in included]
        if case.reduction == "mean":
            grads = [g / total for g in grads]
        apply(grads, tuple(included))
    return full_state(model, opt), model, opt


def run_plain_micro(case: Case):
    """The plain optimizer on the micro-batches themselves (what n=1 must be)."""
    xs, ys = case.data()
    model = model_for(case.model)
    opt = make_plain(case)
    if case.build_first:
        opt.build(model.trainable_variables)
    step = micro_step_fn(model, opt, case.mode)
    for i in range(case.micro_steps):
        lo, hi = case.start(i), case.start(i + 1)
        step(_rows(xs, lo, hi), _rows(ys, lo, hi), case.heads[i])
    return full_state(model, opt), model, opt
