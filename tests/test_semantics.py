"""Per-update features, execution modes and edge cases equal large batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.support import (
    MODES,
    assert_states_close,
    assert_states_equal,
    fit,
    fit_pair,
    full_state,
    make_data,
    make_embedding_model,
    make_mlp,
)

N, B, CYCLES = 3, 4, 3


# ----------------------------------------------------------------------
# The read-only view of the accumulation state.


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_state_shows_the_sums_of_the_current_cycle(mode):
    """`accumulation_state` holds, mid-cycle, the sum of the micro-gradients
    (computed here independently) and the micro-step count; after the
    apply step, zeros."""
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(0.1), N, mode=mode)
    assert opt.accumulation_state is None
    opt.build(model.trainable_variables)
    x, y = make_data(B * N)
    loss_fn = keras.losses.MeanSquaredError()
    expected = [np.zeros(v.shape, "float32") for v in model.trainable_variables]
    for k in range(N):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[k * B : (k + 1) * B], model(x[k * B : (k + 1) * B]))
        grads = tape.gradient(loss, model.trainable_variables)
        weight = float(k + 1)
        if k < N - 1:
            expected = [e + weight * g.numpy() for e, g in zip(expected, grads)]
        opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)
        state = opt.accumulation_state
        if k < N - 1:
            assert int(state.micro_step) == k + 1
            assert float(state.weight_total) == sum(range(1, k + 2))
            for acc, e in zip(state.accumulators, expected):
                np.testing.assert_allclose(acc.numpy(), e, rtol=1e-6, atol=1e-7)
    assert [id(v) for v in state.variables] == [id(v) for v in model.trainable_variables]
    assert int(state.micro_step) == 0 and float(state.weight_total) == 0.0
    assert all(not np.any(a.numpy()) for a in state.accumulators)


# ----------------------------------------------------------------------
# Things the optimizer does once per update happen once per cycle.

PER_UPDATE = {
    "lr_schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)
    ),
    "clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
    "weight_decay_sgd": lambda: keras.optimizers.SGD(0.1, weight_decay=0.1),
    "weight_decay_adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.5),
    "ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    "ema_overwrite": lambda: keras.optimizers.SGD(
        0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PER_UPDATE))
def test_per_update_features_act_once_per_cycle(name, mode):
    ref, acc, _, _ = fit_pair(PER_UPDATE[name], n=N, micro_batch=B, cycles=CYCLES, mode=mode)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)


def test_learning_rate_schedule_sees_applied_updates():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1, 2], [1e-2, 1e-3, 1e-4])
    _, _, _, opt = fit_pair(lambda: keras.optimizers.SGD(schedule), n=N, cycles=CYCLES)
    assert int(opt.iterations) == CYCLES
    np.testing.assert_allclose(float(opt.learning_rate), 1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_variable_constraints_apply_once_per_cycle(mode):
    def model():
        return make_mlp(kernel_constraint=keras.constraints.MaxNorm(0.3))

    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.SGD(0.5), n=N, make_model=model, mode=mode
    )
    assert_states_close(ref, acc)


def _sparse_data(unique_per_cycle: bool, vocab: int = 40):
    rng = np.random.default_rng(1)
    if unique_per_cycle:
        ids = [rng.permutation(vocab)[: B * N * 3] for _ in range(CYCLES)]
        x = np.concatenate(ids).reshape(-1, 3).astype("int32")
    else:
        x = rng.integers(0, 8, size=(B * N * CYCLES, 3)).astype("int32")
    y = rng.normal(size=(len(x), 2)).astype("float32")
    return x, y


def _embedding_model():
    return make_embedding_model(vocab=40)


def test_embedding_gradients_are_sparse():
    x, y = _sparse_data(False)
    model = _embedding_model()
    grads = _grads(model, x[:B], y[:B])
    assert isinstance(grads[0], tf.IndexedSlices)  # the case under test


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.RMSprop(1e-2),
    ],
    ids=["adam", "adagrad", "rmsprop"],
)
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_rows_unique_within_a_cycle(make, mode):
    """Non-linear optimizers: each embedding row occurs once per cycle.

    Keras 3 squares the values of an `IndexedSlices` gradient before summing
    repeated rows, so for Adam-like optimizers the large-batch result depends
    on how often a row repeats; the accumulated gradient holds the summed
    rows. With rows unique within a cycle the two agree exactly.
    """
    ref, acc, _, _ = fit_pair(
        make, n=N, make_model=_embedding_model, data=_sparse_data(True), mode=mode
    )
    assert_states_close(ref, acc)


@pytest.mark.parametrize(
    "make",
    [lambda: keras.optimizers.SGD(0.5), lambda: keras.optimizers.SGD(0.5, momentum=0.9)],
    ids=["sgd", "sgd_momentum"],
)
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_with_repeated_rows(make, mode):
    """Optimizers linear in the gradient: repeated rows make no difference."""
    ref, acc, _, _ = fit_pair(
        make, n=N, make_model=_embedding_model, data=_sparse_data(False), mode=mode
    )
    assert_states_close(ref, acc)


# ----------------------------------------------------------------------
# Execution modes.

COMPILE_MODES = {
    "graph": {},
    "run_eagerly": {"run_eagerly": True},
    "jit_compile": {"jit_compile": True},
    "steps_per_execution": {"steps_per_execution": 2},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("execution", sorted(COMPILE_MODES))
def test_fit_execution_modes(execution, mode):
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=N, mode=mode, **COMPILE_MODES[execution]
    )
    assert_states_close(ref, acc)


def _reference_loop(make_opt, x, y, batch):
    model = make_mlp()
    opt = make_opt()
    loss_fn = keras.losses.MeanSquaredError()
    for start in range(0, len(x), batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[start : start + batch], model(x[start : start + batch]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return full_state(model, opt)


LOOPS = {
    "eager": lambda f: f,
    "tf_function": tf.function,
    "tf_function_jit": lambda f: tf.function(f, jit_compile=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("entry", ["apply_gradients", "apply"])
def test_custom_training_loops(loop, entry, mode):
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    x, y = make_data(B * N * CYCLES)
    ref = _reference_loop(make_opt, x, y, B * N)

    model = make_mlp()
    opt = accumulate(make_opt(), N, mode=mode)
    loss_fn = keras.losses.MeanSquaredError()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(IN_BETWEEN))
def test_in_between_micro_steps_leave_all_state_bit_identical(name, mode):
    x, y = make_data(B * N * CYCLES)
    model = make_mlp()
    opt = accumulate(IN_BETWEEN[name](), N, mode=mode)
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_kind", ["dense", "sparse"])
def test_n_equal_one_is_the_plain_optimizer_bit_for_bit(loss_kind, mode):
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
        make_model = _embedding_model
    ref_model, ref_opt = make_model(), make_opt()
    fit(ref_model, ref_opt, x, y, B)
    model, opt = make_model(), accumulate(make_opt(), 1, mode=mode)
    fit(model, opt, x, y, B)
    ref, acc = full_state(ref_model, ref_opt), full_state(model, opt)
    assert_states_equal(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_sum_reduction_matches_sum_reduced_large_batch(mode):
    loss = keras.losses.MeanSquaredError(reduction="sum")
    ref, acc, _, opt = fit_pair(
        lambda: keras.optimizers.SGD(1e-3, momentum=0.5),
        n=N,
        loss=loss,
        wrap=lambda o, n: accumulate(o, n, reduction="sum", mode=mode),
    )
    assert opt.reduction == "sum"
    assert_states_close(ref, acc)


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
@pytest.mark.parametrize("mode", MODES)
def test_none_gradients_count_as_zeros_and_are_still_applied(mode, missing_at, traced):
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
        grads = [g.numpy() for g in _grads(model, x[start : start + B], y[start : start + B])]
        return grads, MISSING[missing_at](k)

    ref_model, ref_opt = make_mlp(), make_opt()
    model, opt = make_mlp(), accumulate(make_opt(), N, mode=mode)
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
@pytest.mark.parametrize("mode", MODES)
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


def _grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
    return tape.gradient(loss, model.trainable_variables)


# ----------------------------------------------------------------------
# Building and wrapping.


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap", "by_fit"])
def test_build_before_or_after_wrapping(when):
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    x, y = make_data(B * N * CYCLES)
    ref_model, ref_opt = make_mlp(), make_opt()
    fit(ref_model, ref_opt, x, y, B * N)

    model, inner = make_mlp(), make_opt()
    if when == "before_wrap":
        inner.build(model.trainable_variables)
    opt = accumulate(inner, N)
    assert opt.built == (when == "before_wrap")
    if when == "after_wrap":
        opt.build(model.trainable_variables)
        assert opt.built
    fit(model, opt, x, y, B)
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def test_wrapping_a_trained_optimizer_keeps_its_state():
    """Train plainly for 2 large batches, then continue accumulated."""
    x, y = make_data(B * N * 4)
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    ref_model, ref_opt = make_mlp(), make_opt()
    fit(ref_model, ref_opt, x, y, B * N)

    model, inner = make_mlp(), make_opt()
    fit(model, inner, x[: 2 * B * N], y[: 2 * B * N], B * N)
    opt = accumulate(inner, N)
    assert int(opt.iterations) == 2
    fit(model, opt, x[2 * B * N :], y[2 * B * N :], B)
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def test_decorator_for_a_class_and_a_factory():
    AccAdam = accumulate(n=N)(keras.optimizers.Adam)
    opt = AccAdam(1e-2)
    assert opt.n == N and isinstance(opt, keras.optimizers.Adam)

    @accumulate(n=2, reduction="sum")
    def make():
        return keras.optimizers.SGD(0.1)

    opt2 = make()
    assert (opt2.n, opt2.reduction) == (2, "sum")
    assert make() is not opt2
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=N, wrap=lambda o, n: accumulate(n=n)(lambda: o)()
    )
    assert_states_close(ref, acc)


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


# ----------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("bad_n", [0, -1, 2.0, "4", True, False, None])
def test_bad_n(bad_n):
    error = ValueError if isinstance(bad_n, int) and not isinstance(bad_n, bool) else TypeError
    with pytest.raises(error, match="`n`|requires `n`"):
        accumulate(keras.optimizers.SGD(), bad_n)


def test_n_accepts_numpy_integers():
    assert accumulate(keras.optimizers.SGD(), np.int64(3)).n == 3


@pytest.mark.parametrize("bad", [object(), "adam", keras.optimizers.Adam, 4])
def test_not_an_optimizer(bad):
    with pytest.raises(TypeError, match="`optimizer` must be an optimizer instance"):
        accumulate(bad, 2)


def test_rejects_double_accumulation():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        accumulate(keras.optimizers.Adam(gradient_accumulation_steps=2), 2)
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer"):
        accumulate(accumulate(keras.optimizers.Adam(), 2), 2)


def test_backends_that_cannot_train_are_refused_by_name(monkeypatch):
    """On a backend gradaccum does not run on, wrapping fails at once and
    names it, instead of failing later inside `build` or `fit`. (JAX and
    PyTorch run in their own environments: tests/backends.)"""
    monkeypatch.setattr(keras.config, "backend", lambda: "numpy")
    with pytest.raises(ValueError, match="'numpy', which cannot train.*KERAS_BACKEND"):
        accumulate(keras.optimizers.Adam(), 2)
    with pytest.raises(ValueError, match="'numpy'"):
        accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), 2)


def test_unknown_reduction():
    with pytest.raises(ValueError, match="`reduction`"):
        accumulate(keras.optimizers.Adam(), 2, reduction="avg")
    with pytest.raises(ValueError, match="`reduction`"):
        accumulate(n=2, reduction=None)


def test_decorator_rejects_non_callables():
    with pytest.raises(TypeError, match="decorates an optimizer class or factory"):
        accumulate(n=2)(3)


def test_gradient_for_unknown_variable():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(), 2)
    opt.build(model.trainable_variables)
    stranger = keras.Variable(np.zeros((2,), "float32"), name="stranger")
    with pytest.raises(ValueError, match="stranger.*not built for"):
        opt.apply_gradients([(tf.zeros((2,)), stranger)])


def test_all_gradients_none():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(), 2)
    with pytest.raises(ValueError, match="No gradients"):
        opt.apply_gradients([(None, v) for v in model.trainable_variables])


def test_gradient_count_mismatch():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(), 2)
    opt.build(model.trainable_variables)
    with pytest.raises(ValueError, match="Received 1 gradients"):
        opt.apply([tf.zeros((3,))])


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
