"""Custom loops (eager, tf.function), minimize, fit modes, per-update features.

Every test compares against the plain optimizer on the large batch from the
same initial weights and data order; in-between micro-steps must leave every
weight, slot and `iterations` bit-identical.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradaccum import accumulate
from gradaccum.callbacks import FlushPartialCycle, GradientNoiseScale
from tests.atomic_steps.test_atomic_steps import Injected, fail_once
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
    whole_state,
)
from tests.training.test_optimizers_tf_keras import LEGACY_OPTIMIZERS, OPTIMIZERS

new = tf_keras.optimizers
legacy = tf_keras.optimizers.legacy

ALL = [pytest.param(m, id=k) for k, m in OPTIMIZERS.items()] + [
    pytest.param(m, id=f"legacy_{k}") for k, m in LEGACY_OPTIMIZERS.items()
]
BOTH_ADAM = [
    pytest.param(lambda: new.Adam(1e-2), id="adam"),
    pytest.param(lambda: legacy.Adam(1e-2), id="legacy_adam"),
]


def _custom_loop_pair(
    make_optimizer,
    n,
    step,
    micro_batch=4,
    cycles=3,
    make_model=make_mlp,
    data=None,
    mode="masked",
):
    """Reference and subject trained by `step(model, opt, x, y)` per batch.

    Returns `(reference_state, subject_state, in_between)`, where
    `in_between` lists `(before, after)` subject states of every micro-step
    that is not an apply step.
    """
    x, y = data if data is not None else make_data(micro_batch * n * cycles)
    ref_model, ref_opt = make_model(), make_optimizer()
    for xb, yb in split(x, y, micro_batch * n):
        step(ref_model, ref_opt, xb, yb)
    model, opt = make_model(), accumulate(make_optimizer(), n, mode=mode)
    in_between = []
    for i, (xb, yb) in enumerate(split(x, y, micro_batch)):
        before = full_state(model, opt) if i >= n else None
        step(model, opt, xb, yb)
        if before is not None and (i + 1) % n:
            in_between.append((before, full_state(model, opt)))
    return full_state(ref_model, ref_opt), full_state(model, opt), in_between


def _apply_step(model, opt, x, y):
    opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))


def _traced_per_model(fn, jit_compile=False):
    """`fn(model, opt, x, y)` as one tf.function per (model, optimizer)."""
    cache = {}

    def call(model, opt, x, y):
        key = (id(model), id(opt))
        if key not in cache:
            cache[key] = tf.function(
                lambda x, y: fn(model, opt, x, y), jit_compile=jit_compile
            )
        cache[key](tf.constant(x), tf.constant(y))

    return call


@pytest.mark.parametrize("make", ALL)
def test_eager_loop_matches_large_batch(make):
    ref, acc, in_between = _custom_loop_pair(make, 3, _apply_step)
    assert acc["iterations"] == 3
    assert_states_close(ref, acc)
    assert len(in_between) == 4
    for before, after in in_between:
        assert_states_equal(before, after)


@pytest.mark.parametrize(
    "make",
    BOTH_ADAM
    + [
        pytest.param(lambda: new.Nadam(1e-2), id="nadam"),
        pytest.param(lambda: legacy.Nadam(1e-2), id="legacy_nadam"),
        pytest.param(
            lambda: new.AdamW(1e-2, weight_decay=0.05, use_ema=True), id="adamw_ema"
        ),
    ],
)
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_tf_function_loop_matches_large_batch(make, jit_compile):
    step = _traced_per_model(_apply_step, jit_compile=jit_compile)
    ref, acc, in_between = _custom_loop_pair(make, 3, step)
    assert acc["iterations"] == 3
    assert_states_close(ref, acc)
    for before, after in in_between:
        assert_states_equal(before, after)


@pytest.mark.parametrize("make", BOTH_ADAM)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_minimize_with_tape_and_with_callable_loss(make, traced):
    loss_fn = tf_keras.losses.MeanSquaredError()

    def tape_step(model, opt, x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)

    def callable_step(model, opt, x, y):
        loss = lambda: loss_fn(y, model(x, training=True))  # noqa: E731
        opt.minimize(loss, model.trainable_variables)

    for step in (tape_step, callable_step):
        ref, acc, in_between = _custom_loop_pair(
            make, 3, _traced_per_model(step) if traced else step
        )
        assert acc["iterations"] == 3
        assert_states_close(ref, acc)
        for before, after in in_between:
            assert_states_equal(before, after)


@pytest.mark.parametrize("make", BOTH_ADAM)
@pytest.mark.parametrize(
    "compile_kwargs",
    [
        {"run_eagerly": True},
        {"jit_compile": True},
        {"steps_per_execution": 2},
    ],
    ids=["run_eagerly", "jit_compile", "steps_per_execution"],
)
def test_fit_modes(make, compile_kwargs):
    ref, acc, _, opt = fit_pair(make, n=3, micro_batch=4, cycles=2, **compile_kwargs)
    assert acc["iterations"] == 2
    assert int(opt.micro_step) == 0
    assert_states_close(ref, acc)


def schedule():
    return new.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)


FEATURES = {
    "clipnorm": lambda: new.SGD(0.1, clipnorm=0.05),
    "global_clipnorm": lambda: new.Adam(1e-2, global_clipnorm=0.05),
    "clipvalue": lambda: new.SGD(0.1, clipvalue=0.01),
    "weight_decay": lambda: new.SGD(0.1, momentum=0.9, weight_decay=0.1),
    "ema_overwrite": lambda: new.SGD(
        0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    "lr_schedule": lambda: new.Adam(schedule()),
    "legacy_clipnorm": lambda: legacy.SGD(0.1, clipnorm=0.05),
    "legacy_global_clipnorm": lambda: legacy.Adam(1e-2, global_clipnorm=0.05),
    "legacy_clipvalue": lambda: legacy.SGD(0.1, clipvalue=0.01),
    "legacy_decay": lambda: legacy.SGD(0.1, momentum=0.9, decay=0.5),
    "legacy_lr_schedule": lambda: legacy.Adam(schedule()),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_per_update_features_act_once_per_cycle(name):
    ref, acc, _, _ = fit_pair(FEATURES[name], n=3, micro_batch=4, cycles=3)
    assert acc["iterations"] == 3
    assert_states_close(ref, acc)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: new.SGD(0.1), id="sgd"),
        pytest.param(lambda: legacy.SGD(0.1), id="legacy_sgd"),
    ],
)
def test_variable_constraints_act_once_per_cycle(make):
    def model():
        return make_mlp(kernel_constraint=tf_keras.constraints.MaxNorm(0.3))

    ref, acc, _, _ = fit_pair(make, n=3, make_model=model)
    assert_states_close(ref, acc)


@pytest.mark.parametrize(
    "make",
    BOTH_ADAM + [pytest.param(lambda: legacy.Adagrad(0.1), id="legacy_adagrad")],
)
@pytest.mark.parametrize("mode", MODES)
def test_sparse_embedding_gradients(make, mode):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 20, size=(36, 3)).astype("int32")
    y = rng.normal(size=(36, 2)).astype("float32")
    ref, acc, in_between = _custom_loop_pair(
        make, 3, _sparse_step, make_model=make_embedding_model, data=(x, y), mode=mode
    )
    assert_states_close(ref, acc)
    for before, after in in_between:
        assert_states_equal(before, after)


def _sparse_step(model, opt, x, y):
    grads = gradients(model, x, y)
    assert any(isinstance(g, tf.IndexedSlices) for g in grads)
    opt.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (lambda: new.Adam(1e-2), {"skip_gradients_aggregation": True}),
        (lambda: new.Adam(1e-2), {"experimental_aggregate_gradients": False}),
        (lambda: new.Adam(1e-2), {"name": "update"}),
        (lambda: legacy.Adam(1e-2), {"experimental_aggregate_gradients": False}),
        (lambda: legacy.Adam(1e-2), {"name": "update"}),
    ],
    ids=[
        "skip_aggregation",
        "no_aggregation",
        "name",
        "legacy_no_aggregation",
        "legacy_name",
    ],
)
def test_apply_gradients_takes_the_tf_keras_arguments(make, kwargs):
    def step(model, opt, x, y):
        grads = gradients(model, x, y)
        opt.apply_gradients(zip(grads, model.trainable_variables), **kwargs)

    ref, acc, in_between = _custom_loop_pair(make, 3, step)
    assert_states_close(ref, acc)
    for before, after in in_between:
        assert_states_equal(before, after)


@pytest.mark.parametrize("make", BOTH_ADAM)
def test_wrapping_a_trained_optimizer_keeps_its_state(make):
    x, y = make_data(4 * 3 * 4)
    ref_model, ref_opt = make_mlp(), make()
    model, opt = make_mlp(), make()
    # Two plain large-batch steps on both, then the subject accumulates.
    for xb, yb in split(x[:24], y[:24], 12):
        _apply_step(ref_model, ref_opt, xb, yb)
        _apply_step(model, opt, xb, yb)
    for xb, yb in split(x[24:], y[24:], 12):
        _apply_step(ref_model, ref_opt, xb, yb)
    acc = accumulate(opt, 3)
    for xb, yb in split(x[24:], y[24:], 4):
        _apply_step(model, acc, xb, yb)
    assert int(acc.iterations.numpy()) == 4
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, acc))


def _xla_update(make):
    """The optimizer as on a GPU: tf_keras turns `jit_compile` off without one."""

    def make_xla():
        opt = make()
        opt.jit_compile = True  # updates run in `_update_step_xla`
        return opt

    return make_xla


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: new.Adam(1e-2), id="adam"),
        pytest.param(lambda: new.Nadam(1e-2), id="nadam"),
        pytest.param(
            lambda: new.AdamW(1e-2, weight_decay=0.05, use_ema=True), id="adamw_ema"
        ),
    ],
)
@pytest.mark.parametrize("loop", ["fit", "eager"])
def test_xla_compiled_update_step(make, loop):
    if loop == "fit":
        ref, acc, _, _ = fit_pair(_xla_update(make), n=3)
        in_between = []
    else:
        ref, acc, in_between = _custom_loop_pair(_xla_update(make), 3, _apply_step)
    assert acc["iterations"] == 3
    assert_states_close(ref, acc)
    for before, after in in_between:
        assert_states_equal(before, after)


@pytest.mark.parametrize("make", BOTH_ADAM)
def test_weighted_ragged_micro_batches_and_flush(make):
    """Sizes 4, 2, 6 weighted by size make one large batch of 12; `flush()`
    applies a partial cycle as a large batch of what it holds."""
    x, y = make_data(12 * 2 + 5)
    ref_model, ref_opt = make_mlp(), make()
    for lo, hi in ((0, 12), (12, 24), (24, 29)):
        _apply_step(ref_model, ref_opt, x[lo:hi], y[lo:hi])
    model, opt = make_mlp(), accumulate(make(), 3)
    bounds = [0, 4, 6, 12, 16, 18, 24, 27, 29]
    for lo, hi in zip(bounds, bounds[1:]):
        grads = gradients(model, x[lo:hi], y[lo:hi])
        opt.apply_gradients(zip(grads, model.trainable_variables), weight=hi - lo)
    assert int(opt.iterations.numpy()) == 2 and int(opt.micro_step) == 2
    opt.flush()
    assert int(opt.micro_step) == 0
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (lambda: new.Adam(1e-2), {"name": "update"}),
        (lambda: legacy.Adam(1e-2), {"experimental_aggregate_gradients": False}),
    ],
    ids=["name", "legacy_no_aggregation"],
)
def test_n_1_is_the_plain_optimizer_bit_for_bit(make, kwargs):
    x, y = make_data(12)
    ref_model, ref_opt = make_mlp(), make()
    model, opt = make_mlp(), accumulate(make(), 1)
    for xb, yb in split(x, y, 4):
        for m, o in ((ref_model, ref_opt), (model, opt)):
            grads = gradients(m, xb, yb)
            o.apply_gradients(zip(grads, m.trainable_variables), **kwargs)
    assert_states_equal(full_state(ref_model, ref_opt), full_state(model, opt))


@pytest.mark.parametrize("make", BOTH_ADAM)
def test_gradaccum_callbacks_run_in_fit(make):
    """gradaccum's callbacks, Keras 3 callbacks, run in tf_keras's `fit`:
    `FlushPartialCycle` applies each epoch's partial cycle as a large batch
    of what it holds (40 samples: large batches of 12, 12, 12 and 4), and
    `GradientNoiseScale` logs."""
    x, y = make_data(40)
    reference = fit(make_mlp(), make(), x, y, 12, epochs=2)
    opt = accumulate(make(), 3, noise_scale=True)
    model = fit(make_mlp(), opt, x, y, 4, epochs=2,
                fit_kwargs={"callbacks": [FlushPartialCycle(), GradientNoiseScale()]})
    assert int(opt.iterations.numpy()) == 8 and int(opt.micro_step) == 0
    assert_states_close(full_state(reference, reference.optimizer), full_state(model, opt))
    assert len(model.history.history["noise_scale"]) == 2


@pytest.mark.parametrize("make", BOTH_ADAM)
@pytest.mark.parametrize("mode", MODES)
def test_failed_eager_apply_step_changes_nothing(make, mode):
    """The wrapped update raises on the apply step (its first per-variable
    update, before it writes): weights, slots, `iterations`, accumulators and
    counters are as before, and the micro-batch retried ends as the large
    batch."""
    x, y = make_data(24)
    batches = split(x, y, 4)  # two cycles of three
    model, opt = make_mlp(), accumulate(make(), 3, mode=mode)
    train_steps(model, opt, batches[:2], entry="apply_gradients")
    before = whole_state(model, opt)
    fail_once(opt)
    with pytest.raises(Injected):
        train_steps(model, opt, batches[2:3], entry="apply_gradients")
    assert_states_equal(before, whole_state(model, opt), "a failed apply step")
    train_steps(model, opt, batches[2:], entry="apply_gradients")
    reference, plain = make_mlp(), make()
    train_steps(reference, plain, [(x[:12], y[:12]), (x[12:], y[12:])], entry="apply_gradients")
    assert_states_close(full_state(reference, plain), full_state(model, opt))
