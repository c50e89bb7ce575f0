"""Adaptive gradient clipping: the accumulated gradient, clipped once per cycle.

The reference trains the plain optimizer on batches of `B * n` in an eager
loop and clips each large-batch gradient with `tests.helpers.agc.np_agc`, a NumPy
rendering of the paper's reference code written independently of
`gradaccum._agc`. The subject trains `accumulate(optimizer, n, agc=...)` on
micro-batches of `B`. Both start from the same weights and see the same data
in the same order.
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import accumulate
from tests.helpers import (
    ATOL,
    MODES,
    assert_states_close,
    assert_states_equal,
    dtype_policy,
    fit,
    full_state,
    gradients,
    make_data,
    make_mlp,
)
from tests.helpers.agc import np_agc, np_unit_norm, train_clipped
from tests.helpers.distribute import mirrored

N = 4
MICRO_BATCH = 4
CYCLES = 3
LR = 1e-2
# Large enough that some units stay under their cap, small enough that most
# are clipped (`test_reference_clips_some_units_and_not_others` checks it).
FACTOR = 0.3
EPS = 1e-3


def make_conv(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(4, 3, activation="tanh", name="conv"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(3, name="out"),
        ],
        name="conv",
    )


def conv_data(samples: int):
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(samples, 5, 5, 2)).astype("float32"),
        rng.normal(size=(samples, 3)).astype("float32"),
    )


def reference(make_model, make_optimizer, x, y, batch, exclude=lambda v: False, factor=FACTOR):
    """Plain optimizer on batches of `batch`, each gradient clipped by `np_agc`.

    Returns `(state, units clipped, units left)`.
    """
    model, opt = make_model(), make_optimizer()
    opt.build(model.trainable_variables)
    clipped, left = train_clipped(
        model, opt, keras.losses.MeanSquaredError(), x, y, batch, factor, EPS, exclude
    )
    return full_state(model, opt), clipped, left


def subject_fit(make_model, optimizer, x, y, batch=MICRO_BATCH, **compile_kwargs):
    model = make_model()
    fit(model, optimizer, x, y, batch, **compile_kwargs)
    return full_state(model, optimizer), model


def _data():
    return make_data(MICRO_BATCH * N * CYCLES)


def _is_out(v) -> bool:
    return v.path.startswith("mlp/out/") or v.path.startswith("out/")


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(LR),
    "adamw": lambda: keras.optimizers.AdamW(LR, weight_decay=0.05),
}


# ----------------------------------------------------------------------
# Unit norms.


@pytest.mark.parametrize(
    "shape",
    [(), (3,), (5, 1), (1, 8), (4, 3), (2, 3, 4), (3, 3, 2, 4), (1, 1, 1, 8), (1, 1, 3, 4)],
)
def test_unit_norms_follow_the_reference_code(shape):
    from gradaccum._agc import unit_axes, unitwise_norm

    a = np.random.default_rng(0).normal(size=shape).astype("float32")
    ours = unitwise_norm(tf.constant(a), unit_axes(shape)).numpy()
    theirs = np_unit_norm(a)
    np.testing.assert_allclose(np.broadcast_to(ours, np.broadcast(ours, theirs).shape),
                               np.broadcast_to(theirs, np.broadcast(ours, theirs).shape),
                               rtol=1e-6)
    # Same units: as many norms as the reference computes.
    assert ours.size == np.size(theirs)


def test_reference_clips_some_units_and_not_others():
    x, y = _data()
    _, clipped, left = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    assert clipped > 0 and left > 0, (clipped, left)


# ----------------------------------------------------------------------
# Equal to the large batch, clipped once.


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_equals_large_batch_clipped(name):
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS[name], x, y, MICRO_BATCH * N)
    opt = accumulate(OPTIMIZERS[name](), N, agc=FACTOR, agc_eps=EPS)
    got, _ = subject_fit(make_mlp, opt, x, y)
    assert_states_close(ref, got)
    assert int(opt.iterations) == CYCLES


def test_clipping_each_micro_batch_would_differ():
    """What the seed package does (clip, then sum) is measurably not the
    large batch's clipped gradient: the equality above can fail."""
    x, y = _data()
    model = make_mlp()
    grads = [
        gradients(model, x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
        for start in range(0, MICRO_BATCH * N, MICRO_BATCH)
    ]
    kernel = model.trainable_variables[0].numpy()
    per_micro = np.mean([np_agc(np.asarray(g[0]), kernel, FACTOR, EPS)[0] for g in grads], axis=0)
    once = np_agc(np.mean([np.asarray(g[0]) for g in grads], axis=0), kernel, FACTOR, EPS)[0]
    assert np.max(np.abs(per_micro - once)) > 100 * ATOL


def test_conv_kernels_clip_per_output_channel():
    x, y = conv_data(MICRO_BATCH * N * CYCLES)
    # Conv units hold 18 weights each: a larger factor leaves some unclipped.
    ref, clipped, left = reference(make_conv, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N, factor=0.5)
    assert clipped > 0 and left > 0
    opt = accumulate(OPTIMIZERS["adam"](), N, agc=0.5)
    got, _ = subject_fit(make_conv, opt, x, y)
    assert_states_close(ref, got)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.Adam(LR, clipnorm=0.01),
        lambda: keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.01),
    ],
    ids=["adam_clipnorm", "sgd_global_clipnorm"],
)
def test_with_keras_clipping_after_agc(make_optimizer):
    """Keras's clipping acts on the AGC-clipped gradient, as in the
    reference, where the plain optimizer receives the clipped gradient."""
    x, y = _data()
    ref, _, _ = reference(make_mlp, make_optimizer, x, y, MICRO_BATCH * N)
    unclipped, _, _ = reference(make_mlp, make_optimizer, x, y, MICRO_BATCH * N, factor=1e6)
    opt = accumulate(make_optimizer(), N, agc=FACTOR)
    got, _ = subject_fit(make_mlp, opt, x, y)
    assert_states_close(ref, got)
    # Keras's clipping alone gives another result: both act.
    key = "model/hidden0/kernel"
    assert np.max(np.abs(ref[key] - unclipped[key])) > 100 * ATOL


@pytest.mark.parametrize("how", ["variables", "paths", "predicate"])
def test_excluded_variables_are_not_clipped(how):
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N, exclude=_is_out)
    all_clipped, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    assert np.max(np.abs(ref["model/out/kernel"] - all_clipped["model/out/kernel"])) > 100 * ATOL
    model = make_mlp()
    if how == "variables":
        exclude = model.get_layer("out").trainable_variables
    elif how == "paths":
        exclude = ["mlp/out/kernel", "mlp/out/bias"]
    else:
        exclude = _is_out
    opt = accumulate(OPTIMIZERS["adam"](), N, agc=FACTOR, agc_exclude=exclude)
    fit(model, opt, x, y, MICRO_BATCH)
    assert_states_close(ref, full_state(model, opt))


def test_n1_is_plain_agc():
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH)
    opt = accumulate(OPTIMIZERS["adam"](), 1, agc=FACTOR)
    got, _ = subject_fit(make_mlp, opt, x, y)
    assert_states_close(ref, got)


def test_n1_sparse_gradients_stay_sparse_and_equal_dense_clipping():
    """An `Embedding` gradient (IndexedSlices) is clipped per unit of the
    whole table, repeated rows summed; SGD is linear, so the dense reference
    must agree."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 6, size=(24, 3)).astype("int32")  # rows repeat
    y = rng.normal(size=(24, 2)).astype("float32")

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((3,), dtype="int32"), keras.layers.Embedding(6, 4, name="emb"),
             keras.layers.Flatten(name="flat"), keras.layers.Dense(2, name="out")],
            name="embed",
        )

    def make_optimizer():
        return keras.optimizers.SGD(0.5)

    ref, clipped, _ = reference(make_model, make_optimizer, x, y, 4)
    assert clipped > 0
    opt = accumulate(make_optimizer(), 1, agc=FACTOR)
    got, _ = subject_fit(make_model, opt, x, y, batch=4)
    assert_states_close(ref, got)


# ----------------------------------------------------------------------
# A custom loop: in-between micro-steps, loss scaling.


def test_custom_loop_loss_scale_optimizer_clips_unscaled_gradients():
    """`accumulate(LossScaleOptimizer(Adam))` in a `tf.function` loop with a
    scaled loss (float32, so the scale is exact): AGC of scaled gradients
    would cap units 2**15 times too late. In-between micro-steps change
    nothing, bit for bit."""
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    model = make_mlp()
    opt = accumulate(
        keras.optimizers.LossScaleOptimizer(OPTIMIZERS["adam"]()), N, agc=FACTOR
    )
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    inner = opt.inner_optimizer  # the accumulating core: Adam's variables
    for k, start in enumerate(range(0, len(x), MICRO_BATCH)):
        before = full_state(model, inner)
        step(x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
        if (k + 1) % N:
            assert_states_equal(before, full_state(model, inner))
    assert_states_close(ref, full_state(model, inner))


def test_mixed_float16_fit_clips_unscaled_gradients():
    """`compile` under `mixed_float16` with `LossScaleOptimizer(accumulate(...))`:
    the accumulating optimizer receives unscaled gradients. The reference
    computes the large batch's float16 gradient in one pass, the subject sums
    four float16 micro-batch gradients, so they differ by float16 rounding
    (relative ~1e-3), not float32's: measured 1.3e-5 at most, hence atol
    5e-5. Clipping gradients scaled by 16 would cap them 16 times later and
    miss by 3e-3 (checked)."""
    x, y = _data()
    with dtype_policy("mixed_float16"):
        ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
        wrong, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N, factor=FACTOR * 16)
        opt = keras.optimizers.LossScaleOptimizer(
            accumulate(OPTIMIZERS["adam"](), N, agc=FACTOR), initial_scale=16.0
        )
        model = make_mlp()
        fit(model, opt, x, y, MICRO_BATCH)
    assert float(opt.dynamic_scale) == 16.0  # no micro-batch dropped
    assert_states_close(ref, full_state(model, opt.inner_optimizer), rtol=2e-3, atol=5e-5)
    key = "model/hidden0/kernel"
    assert np.max(np.abs(wrong[key] - ref[key])) > 10 * 5e-5


def test_loss_scale_factor_is_divided_out_first():
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    opt = accumulate(keras.optimizers.Adam(LR, loss_scale_factor=1024.0), N, agc=FACTOR)
    got, _ = subject_fit(make_mlp, opt, x, y)
    assert_states_close(ref, got)


@pytest.mark.parametrize("jit", (False, True), ids=("graph", "xla"))
def test_split_step_equals_large_batch_clipped(jit):
    """`micro_batch_size`: the batch's mean gradient is clipped once, as the
    large batch's, not each micro-batch's."""
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    opt = accumulate(OPTIMIZERS["adam"](), micro_batch_size=MICRO_BATCH, agc=FACTOR, agc_eps=EPS)
    got, _ = subject_fit(make_mlp, opt, x, y, MICRO_BATCH * N, jit_compile=jit)
    assert_states_close(ref, got)
    assert int(opt.iterations) == CYCLES


# ----------------------------------------------------------------------
# MirroredStrategy: the replicas' sum is clipped, as one device would.


@pytest.mark.parametrize(
    "name,mode",
    [("adam", "masked"), ("adam", "skip"), ("adam_clipnorm", "masked")],
)
def test_mirrored_strategy_equals_one_device(name, mode):
    makers = dict(OPTIMIZERS, adam_clipnorm=lambda: keras.optimizers.Adam(LR, clipnorm=0.01))
    x, y = _data()
    ref, _, _ = reference(make_mlp, makers[name], x, y, MICRO_BATCH * N)
    strategy = mirrored()
    with strategy.scope():
        model = make_mlp()
        opt = accumulate(makers[name](), N, mode=mode, agc=FACTOR)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_states_close(ref, full_state(model, opt))


@pytest.mark.parametrize("mode", MODES)
def test_mirrored_strategy_split_step_equals_one_device(mode):
    """`micro_batch_size` under two replicas: the replicas' sum of the batch
    is clipped once, after the step's loop."""
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH * N)
    with mirrored().scope():
        model = make_mlp()
        opt = accumulate(OPTIMIZERS["adam"](), micro_batch_size=MICRO_BATCH, mode=mode, agc=FACTOR, agc_eps=EPS)
    fit(model, opt, x, y, MICRO_BATCH * N)
    assert_states_close(ref, full_state(model, opt))


def test_mirrored_strategy_n1():
    x, y = _data()
    ref, _, _ = reference(make_mlp, OPTIMIZERS["adam"], x, y, MICRO_BATCH)
    strategy = mirrored()
    with strategy.scope():
        model = make_mlp()
        opt = accumulate(OPTIMIZERS["adam"](), 1, agc=FACTOR)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_states_close(ref, full_state(model, opt))


# ----------------------------------------------------------------------
# Saving.


def test_keras_file_mid_cycle_resumes_bit_identically():
    x, y = _data()
    cut = MICRO_BATCH * (N + 1)  # one cycle and one micro-batch

    def make_opt():
        return accumulate(OPTIMIZERS["adam"](), N, agc=FACTOR, agc_eps=2e-3, agc_exclude=["mlp/out/bias"])

    straight = make_mlp()
    straight.compile(optimizer=make_opt(), loss="mse")
    straight.fit(x[:cut], y[:cut], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    straight.fit(x[cut:], y[cut:], batch_size=MICRO_BATCH, shuffle=False, verbose=0)

    saved = make_mlp()
    saved.compile(optimizer=make_opt(), loss="mse")
    saved.fit(x[:cut], y[:cut], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    saved.save(path)
    loaded = keras.models.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, gradaccum.AccumulatingOptimizer)
    assert (opt.agc, opt.agc_eps, tuple(opt.agc_exclude)) == (FACTOR, 2e-3, ("mlp/out/bias",))
    assert int(opt.micro_step) == 1
    loaded.fit(x[cut:], y[cut:], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_states_equal(full_state(straight, straight.optimizer), full_state(loaded, opt))


def test_checkpoint_mid_cycle_resumes_bit_identically():
    x, y = _data()
    cut = MICRO_BATCH * (N + 2)

    def run(model, opt, xs, ys):
        model.compile(optimizer=opt, loss="mse")
        model.fit(xs, ys, batch_size=MICRO_BATCH, shuffle=False, verbose=0)

    straight, straight_opt = make_mlp(), accumulate(OPTIMIZERS["sgd_momentum"](), N, agc=FACTOR)
    run(straight, straight_opt, x[:cut], y[:cut])
    run(straight, straight_opt, x[cut:], y[cut:])

    first, first_opt = make_mlp(), accumulate(OPTIMIZERS["sgd_momentum"](), N, agc=FACTOR)
    run(first, first_opt, x[:cut], y[:cut])
    prefix = tf.train.Checkpoint(model=first, optimizer=first_opt).save(
        os.path.join(tempfile.mkdtemp(), "ckpt")
    )
    second, second_opt = make_mlp(seed=5), accumulate(OPTIMIZERS["sgd_momentum"](), N, agc=FACTOR)
    second_opt.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second_opt).restore(prefix).assert_consumed()
    assert int(second_opt.micro_step) == 2
    run(second, second_opt, x[cut:], y[cut:])
    assert_states_equal(full_state(straight, straight_opt), full_state(second, second_opt))


@keras.saving.register_keras_serializable(package="gradaccum_tests")
def leave_out_biases(variable) -> bool:
    return len(variable.shape) == 1


def test_config_round_trip():
    from keras.src.saving import serialization_lib

    opt = accumulate(OPTIMIZERS["adam"](), 3, agc=0.02, agc_eps=1e-4, agc_exclude=leave_out_biases)
    config = serialization_lib.serialize_keras_object(opt)
    assert config["config"]["agc"] == 0.02 and config["config"]["agc_eps"] == 1e-4
    again = serialization_lib.deserialize_keras_object(config)
    assert (again.agc, again.agc_eps, again.agc_exclude) == (0.02, 1e-4, leave_out_biases)
    # Off by default, and saved as off.
    plain = serialization_lib.serialize_keras_object(accumulate(OPTIMIZERS["adam"](), 3))
    assert plain["config"]["agc"] is None


def test_copies_carry_the_setting_with_variables_as_paths():
    import copy
    import pickle

    model = make_mlp()
    opt = accumulate(OPTIMIZERS["adam"](), 3, agc=0.02, agc_exclude=model.get_layer("out").trainable_variables)
    for twin in (copy.copy(opt), copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert twin.agc == 0.02
        assert tuple(twin.agc_exclude) == ("mlp/out/kernel", "mlp/out/bias")


# ----------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(agc=-1), ValueError, "`agc`"),
        (dict(agc=0), ValueError, "`agc`"),
        (dict(agc=float("inf")), ValueError, "`agc`"),
        (dict(agc=True), TypeError, "`agc`"),
        (dict(agc="0.01"), TypeError, "`agc`"),
        (dict(agc=0.01, agc_eps=0), ValueError, "`agc_eps`"),
        (dict(agc=0.01, agc_eps=float("nan")), ValueError, "`agc_eps`"),
        (dict(agc=0.01, agc_eps=None), TypeError, "`agc_eps`"),
        (dict(agc=0.01, agc_exclude=3), TypeError, "`agc_exclude`"),
        (dict(agc=0.01, agc_exclude="mlp/out/kernel"), TypeError, "`agc_exclude`"),
        (dict(agc=0.01, agc_exclude=[1.5]), TypeError, "`agc_exclude`"),
        (dict(agc_exclude=["out/kernel"]), ValueError, "`agc_exclude`"),
    ],
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        accumulate(keras.optimizers.SGD(), 2, **kwargs)
