"""TensorFlow's execution modes, traced loops and edge cases equal large batch.

What every backend shares (the optimizers, per-update features, `fit` in
graph mode, eager loops) is in `test_fit.py` and `test_loops.py` beside
this file; here: `run_eagerly`, XLA, `steps_per_execution`, `tf.function`
loops, traces that meet new variables, and the proxy's face to other code. The mode ("masked" or "skip") is a
parameter where XLA compiles the update; elsewhere both modes give the same
bits (`property_tests/test_modes_tensorflow.py`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    fit,
    fit_pair,
    full_state,
    gradients,
    make_data,
    make_embedding_model,
    make_mlp,
    split,
    train_steps,
)

N, B, CYCLES = 3, 4, 3


# ----------------------------------------------------------------------
# Execution modes (graph mode: tests/training/test_fit.py).

COMPILE_MODES = {
    "run_eagerly": {"run_eagerly": True},
    "jit_compile": {"jit_compile": True},
    "steps_per_execution": {"steps_per_execution": 2},
}


@pytest.mark.parametrize(
    "execution, mode",
    [("run_eagerly", "masked"), ("steps_per_execution", "masked"),
     ("jit_compile", "masked"), ("jit_compile", "skip")],
)
def test_fit_execution_modes(execution, mode):
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=N, mode=mode, **COMPILE_MODES[execution]
    )
    assert_states_close(ref, acc)


LOOPS = {
    "eager": lambda f: f,
    "tf_function": tf.function,
    "tf_function_jit": lambda f: tf.function(f, jit_compile=True),
}


@pytest.mark.parametrize(
    "loop, entry, mode",
    # Eagerly through `apply`: tests/training/test_loops.py.
    [("eager", "apply_gradients", "masked")]
    + [("tf_function", entry, "masked") for entry in ("apply", "apply_gradients")]
    + [("tf_function_jit", entry, mode) for entry in ("apply", "apply_gradients")
       for mode in ("masked", "skip")],
)
def test_custom_training_loops(loop, entry, mode):
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    x, y = make_data(B * N * CYCLES)
    ref = train_steps(make_mlp(), make_opt(), split(x, y, B * N))

    model = make_mlp()
    opt = accumulate(make_opt(), N, mode=mode)

    def step(xb, yb):
        grads = gradients(model, xb, yb)
        if entry == "apply":
            opt.apply(grads, model.trainable_variables)
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables))

    step = LOOPS[loop](step)
    for start in range(0, len(x), B):
        step(x[start : start + B], y[start : start + B])
    assert_states_close(ref, full_state(model, opt))


# ----------------------------------------------------------------------
# In-between micro-steps change nothing; n=1 is the plain optimizer.

IN_BETWEEN = {
    "adam_ema_wd": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, use_ema=True),
    "sgd_momentum_clip": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.1),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "lion_schedule": lambda: keras.optimizers.Lion(
        keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=10)
    ),
}


@pytest.mark.parametrize("name", sorted(IN_BETWEEN))
def test_in_between_micro_steps_leave_all_state_bit_identical(name):
    x, y = make_data(B * N * CYCLES)
    model = make_mlp()
    opt = accumulate(IN_BETWEEN[name](), N)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for k, start in enumerate(range(0, len(x), B)):
        before = full_state(model, opt)
        step(x[start : start + B], y[start : start + B])
        after = full_state(model, opt)
        applied = (k + 1) % N == 0
        assert int(opt.micro_step) == (k + 1) % N
        if applied:
            assert int(after["iterations"]) == int(before["iterations"]) + 1
            assert not np.array_equal(
                before["model/out/kernel"], after["model/out/kernel"]
            )
        else:
            assert_states_equal(before, after)


@pytest.mark.parametrize("loss_kind", ["dense", "sparse"])
def test_n_equal_one_is_the_plain_optimizer_bit_for_bit(loss_kind):
    make_opt = lambda: keras.optimizers.Adam(1e-2, clipnorm=1.0)  # noqa: E731
    if loss_kind == "dense":
        x, y = make_data(B * CYCLES)
        make_model = make_mlp
    else:
        rng = np.random.default_rng(3)
        # No index repeats within a batch: a sparse update and its dense
        # equivalent then add identical numbers.
        x = np.stack([rng.permutation(40)[:12].reshape(4, 3) for _ in range(CYCLES)])
        x = x.reshape(-1, 3).astype("int32")
        y = rng.normal(size=(len(x), 2)).astype("float32")
        make_model = lambda: make_embedding_model(vocab=40)  # noqa: E731
    ref_model, ref_opt = make_model(), make_opt()
    fit(ref_model, ref_opt, x, y, B)
    model, opt = make_model(), accumulate(make_opt(), 1)
    fit(model, opt, x, y, B)
    ref, acc = full_state(ref_model, ref_opt), full_state(model, opt)
    assert_states_equal(ref, acc)


# ----------------------------------------------------------------------
# None gradients.


# Micro-steps (k, counted from 0 over the whole run) whose `out/bias`
# gradient is None.
MISSING = {
    # the middle and the last (apply) micro-step of each cycle
    "middle_and_last": lambda k: k % N in (1, N - 1),
    # the first micro-step of each cycle after the first: the sum the previous
    # cycle left must not carry over
    "first": lambda k: k >= N and k % N == 0,
    # the whole second cycle: as in the large batch, the bias is left out of
    # that cycle's update (no step, no change to its moments)
    "whole_cycle": lambda k: k // N == 1,
}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("missing_at", sorted(MISSING))
def test_none_gradients_count_as_zeros_and_are_still_applied(missing_at, traced):
    """Some micro-steps give `out/bias` no gradient; the mean still applies.

    Reference: the plain optimizer applied to the mean of the micro-batch
    gradients, with zeros where a micro-step had none; a cycle in which the
    bias had no gradient at all leaves it out of the update, as the large
    batch would. Traced, the steps with and without the gradient are two
    traces of one `tf.function`.
    """
    x, y = make_data(B * N * CYCLES)
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731

    def micro_grads(model, k, start):
        grads = [g.numpy() for g in gradients(model, x[start : start + B], y[start : start + B])]
        return grads, MISSING[missing_at](k)

    ref_model, ref_opt = make_mlp(), make_opt()
    model, opt = make_mlp(), accumulate(make_opt(), N)
    opt.build(model.trainable_variables)

    def apply(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    if traced:
        apply = tf.function(apply)
    bias_index = [v.path for v in model.trainable_variables].index("mlp/out/bias")
    k = 0
    for cycle in range(CYCLES):
        total = None
        absent = True
        for j in range(N):
            start = (cycle * N + j) * B
            grads, missing = micro_grads(ref_model, k, start)
            if missing:
                grads[bias_index] = np.zeros_like(grads[bias_index])
            absent = absent and missing
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
            sub_grads, missing = micro_grads(model, k, start)
            sub = [tf.constant(g) for g in sub_grads]
            if missing:
                sub[bias_index] = None
            apply(sub)
            k += 1
        pairs = [(tf.constant(t / N), v) for t, v in zip(total, ref_model.trainable_variables)]
        if absent:
            del pairs[bias_index]
        ref_opt.apply_gradients(pairs)
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("mode", ["masked", "skip"])
def test_a_cycle_begun_by_a_step_traced_before_a_variable_took_part(mode, jit):
    """One `tf.function` per gradient pattern (as one per task in
    multi-task training), each traced when its pattern first comes: the one
    for "a only" is traced before `b` ever had a gradient. When it begins a
    later cycle, `b`'s accumulator still holds the last cycle's sum, which
    must not count: the reference applies each cycle's mean of the given
    gradients (zeros where none)."""
    n = 2
    patterns = ["a-", "a-", "-b", "ab", "ab", "ab", "a-", "-b"]
    shapes = [(2,), (3,)]

    def grads(k):
        rng = np.random.default_rng(k)
        return [rng.normal(size=s).astype(np.float32) if c != "-" else None
                for c, s in zip(patterns[k], shapes)]

    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    start = [np.array([1.0, -2.0], np.float32), np.array([0.5, 3.0, -1.0], np.float32)]
    ref_vars = [keras.Variable(v) for v in start]
    ref_opt = make_opt()
    for c in range(len(patterns) // n):
        given = [grads(c * n + j) for j in range(n)]
        mean = [sum(g[i] if g[i] is not None else np.zeros(shapes[i], np.float32) for g in given) / n
                for i in range(2)]
        ref_opt.apply_gradients(zip([tf.constant(m) for m in mean], ref_vars))
    variables = [keras.Variable(v) for v in start]
    opt = accumulate(make_opt(), n, mode=mode)
    opt.build(variables)
    steps = {}
    for k, pattern in enumerate(patterns):
        if pattern not in steps:
            steps[pattern] = tf.function(
                lambda gs: opt.apply_gradients(zip(gs, variables)), jit_compile=jit
            )
        steps[pattern]([None if g is None else tf.constant(g) for g in grads(k)])
    assert len(steps) == 3
    assert int(opt.iterations) == int(ref_opt.iterations) == len(patterns) // n
    for v, r in zip(variables, ref_vars):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("jit", [None, False, True], ids=["eager", "graph", "xla"])
@pytest.mark.parametrize("mode", MODES)
def test_weighted_cycles_of_changing_totals(mode, jit):
    """Cycles whose weight totals go 8, 8, 7, 8, then 4 (flushed after two
    micro-steps), then 8: each applies its own weighted mean, whatever the
    last cycle's total was. The reference applies each cycle's weighted
    mean, computed in float64."""
    n = 4
    cycles = [[2.0] * 4, [2.0] * 4, [2.0, 2.0, 2.0, 1.0], [2.0] * 4, [2.0, 2.0], [2.0] * 4]
    shapes = [(3,), (2, 2)]

    def grads(k):
        rng = np.random.default_rng(100 + k)
        return [rng.normal(size=s).astype(np.float32) for s in shapes]

    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    start = [np.array([1.0, -2.0, 0.5], np.float32), np.array([[0.5, 3.0], [-1.0, 2.0]], np.float32)]
    ref_vars = [keras.Variable(v) for v in start]
    ref_opt = make_opt()
    k = 0
    for weights in cycles:
        sums = [np.zeros(s) for s in shapes]
        for w in weights:
            sums = [t + w * g.astype(np.float64) for t, g in zip(sums, grads(k))]
            k += 1
        mean = [t / sum(weights) for t in sums]
        ref_opt.apply_gradients(zip([tf.constant(m, tf.float32) for m in mean], ref_vars))

    variables = [keras.Variable(v) for v in start]
    opt = accumulate(make_opt(), n, mode=mode)
    opt.build(variables)
    if jit is None:
        def step(gs, w):
            opt.apply_gradients(zip(gs, variables), weight=w)
    else:
        step = tf.function(
            lambda gs, w: opt.apply_gradients(zip(gs, variables), weight=w), jit_compile=jit
        )
    k = 0
    for weights in cycles:
        for w in weights:
            step([tf.constant(g) for g in grads(k)], tf.constant(w))
            k += 1
        if len(weights) < n:
            opt.flush()
    assert int(opt.iterations) == int(ref_opt.iterations) == len(cycles)
    for v, r in zip(variables, ref_vars):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------
# The proxy to other code, and traces that cannot apply.


def test_proxy_is_the_wrapped_optimizer_to_other_code():
    inner = keras.optimizers.Adam(1e-2)
    opt = accumulate(inner, 4)
    assert isinstance(opt, keras.optimizers.Optimizer)
    assert isinstance(opt, keras.optimizers.Adam)
    assert opt.__wrapped__ is inner
    assert opt.get_config() == inner.get_config()
    opt.learning_rate = 0.5
    np.testing.assert_allclose(float(inner.learning_rate), 0.5)
    assert opt.variables == inner.variables
    assert opt.iterations is inner.iterations
    assert int(opt.micro_step) == 0
    assert "n=4" in repr(opt) and "Adam" in repr(opt)


def test_traced_step_that_left_out_a_variable_refuses_to_drop_its_gradients():
    """Multi-task: a step traced before a head first had gradients.

    `step_a` only trains head a and is traced first; `step_ab` then gives head
    b gradients. When `step_a` runs the apply step it cannot apply head b's
    accumulated gradients: it raises rather than dropping them silently.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    head_a = keras.layers.Dense(2, name="a")(inputs)
    head_b = keras.layers.Dense(2, name="b")(inputs)
    model = keras.Model(inputs, [head_a, head_b])
    opt = accumulate(keras.optimizers.SGD(0.1), 2)
    opt.build(model.trainable_variables)
    x, y = make_data(B, out_dim=2)

    def make_step(heads):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                outs = model(x)
                loss = sum(tf.reduce_mean((outs[h] - y) ** 2) for h in heads)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        return step

    step_a, step_ab = make_step([0]), make_step([0, 1])
    step_a()  # traced while head b has never had a gradient
    opt.flush()
    step_ab()  # head b accumulates
    with pytest.raises(tf.errors.InvalidArgumentError, match="leaves them out"):
        step_a()  # apply step: head b's gradients cannot be applied here
