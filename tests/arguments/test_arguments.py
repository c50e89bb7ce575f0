"""The arguments of `accumulate()` and of a micro-step, on every backend:
bad ones fail early and name the argument; good ones are carried by
configs and copies."""

from __future__ import annotations

import pickle

import keras
import numpy as np
import pytest

import gradaccum
import gradaccum.callbacks
import gradaccum.layers
import gradaccum.schedules
from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import (
    BACKEND,
    assert_states_close,
    assert_states_equal,
    full_state,
    gradients,
    make_data,
    make_mlp,
    split,
    train_steps,
)


@pytest.mark.parametrize("bad_n", [0, -1, 2.0, "4", True, False, None])
def test_bad_n(bad_n):
    error = ValueError if isinstance(bad_n, int) and not isinstance(bad_n, bool) else TypeError
    with pytest.raises(error, match="`n`|requires `n`"):
        accumulate(keras.optimizers.SGD(), bad_n)


def test_n_accepts_numpy_integers():
    assert accumulate(keras.optimizers.SGD(), np.int64(3)).n == 3


def test_bad_n_settings():
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    for bad, error in [(0, ValueError), (2.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="`n`"):
            opt.n = bad
    scheduled = accumulate(keras.optimizers.Adam(1e-2), n=lambda step: 2)
    with pytest.raises(ValueError, match="schedule"):
        scheduled.n = 3
    zero = accumulate(keras.optimizers.Adam(1e-2), n=lambda step: 0)
    model = make_mlp()
    x, y = make_data(4)
    with pytest.raises(ValueError, match="returned 0"):
        zero.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))


@pytest.mark.parametrize("bad", [object(), "adam", keras.optimizers.Adam, 4])
def test_not_an_optimizer(bad):
    with pytest.raises(TypeError, match="`optimizer` must be an optimizer instance"):
        accumulate(bad, 2)


def test_rejects_double_accumulation():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        accumulate(keras.optimizers.Adam(gradient_accumulation_steps=2), 2)
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer"):
        accumulate(accumulate(keras.optimizers.Adam(), 2), 2)


def test_unknown_reduction():
    with pytest.raises(ValueError, match="`reduction`"):
        accumulate(keras.optimizers.Adam(), 2, reduction="avg")
    with pytest.raises(ValueError, match="`reduction`"):
        accumulate(n=2, reduction=None)


def test_decorator_rejects_non_callables():
    with pytest.raises(TypeError, match="decorates an optimizer class or factory"):
        accumulate(n=2)(3)


def test_unknown_weigh_by_is_refused():
    with pytest.raises(ValueError, match="weigh_by"):
        accumulate(keras.optimizers.SGD(), 2, weigh_by="tokens")
    with pytest.raises(ValueError, match="weigh_by"):
        accumulate(n=2, weigh_by=None)


def test_weigh_by_survives_configs_pickles_and_copies():
    opt = accumulate(keras.optimizers.SGD(), 2, weigh_by="batch")
    config = keras.saving.serialize_keras_object(opt)
    assert config["config"]["weigh_by"] == "batch"
    assert keras.saving.deserialize_keras_object(config).weigh_by == "batch"
    assert pickle.loads(pickle.dumps(opt)).weigh_by == "batch"
    assert "weigh_by='batch'" in repr(opt)
    assert accumulate(keras.optimizers.SGD(), 2).weigh_by == "count"
    assert isinstance(opt, AccumulatingOptimizer)


# ----------------------------------------------------------------------
# `mode`: accepted on every backend (it changes what runs on TensorFlow
# only), checked, and carried by configs.


def test_default_mode_is_masked():
    opt = accumulate(keras.optimizers.SGD(), 2)
    assert opt.mode == "masked"
    assert "mode='masked'" in repr(opt)


def test_mode_in_every_entry_point():
    assert accumulate(keras.optimizers.SGD(), 2, mode="skip").mode == "skip"
    assert accumulate(n=2, mode="skip")(keras.optimizers.SGD)().mode == "skip"
    assert AccumulatingOptimizer(keras.optimizers.SGD(), 2, mode="skip").mode == "skip"


@pytest.mark.parametrize("bad", ["fast", "Skip", "", None, 1, True])
def test_unknown_mode(bad):
    with pytest.raises(ValueError, match="`mode` must be one of"):
        accumulate(keras.optimizers.SGD(), 2, mode=bad)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        accumulate(n=2, mode=bad)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        AccumulatingOptimizer(keras.optimizers.SGD(), 2, mode=bad)


@pytest.mark.parametrize("setting", ["masked", "skip"])
def test_config_round_trip_keeps_the_mode(setting):
    lso = keras.optimizers.LossScaleOptimizer
    for opt in (
        accumulate(keras.optimizers.Adam(), 3, mode=setting),
        accumulate(lso(keras.optimizers.Adam()), 3, mode=setting),
    ):
        assert opt.mode == setting
        again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
        assert issubclass(type(again), AccumulatingOptimizer)
        assert (again.n, again.mode) == (3, setting)


def test_sparse_slices_is_refused_by_name_off_tensorflow():
    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow keeps slices (tests/sparse/test_sparse_tensorflow.py)")
    with pytest.raises(ValueError, match="sparse='slices'.*TensorFlow"):
        accumulate(keras.optimizers.SGD(1e-2), 2, sparse="slices")


# ----------------------------------------------------------------------
# A micro-step's gradients and weight.


@pytest.mark.parametrize("entry", ["apply", "apply_gradients"])
def test_every_gradient_none_raises(entry):
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), 2)
    with pytest.raises(ValueError, match="No gradients"):
        if entry == "apply":
            opt.apply([None] * len(model.trainable_variables), model.trainable_variables)
        else:
            opt.apply_gradients([(None, v) for v in model.trainable_variables])


def test_gradient_for_unknown_variable():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(), 2)
    opt.build(model.trainable_variables)
    stranger = keras.Variable(np.zeros((2,), "float32"), name="stranger")
    with pytest.raises(ValueError, match="stranger.*not built for"):
        opt.apply_gradients([(keras.ops.zeros((2,)), stranger)])


@pytest.mark.parametrize(
    "bad, error",
    [(-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
     (True, TypeError), ("4", TypeError), ("tensor", ValueError), ("vector", ValueError)],
)
@pytest.mark.parametrize("entry", ["apply", "apply_gradients"])
def test_bad_weight(entry, bad, error):
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), 2)
    x, y = make_data(4)
    if bad == "tensor":
        bad = keras.ops.convert_to_tensor(-2.0)
        # PyTorch checks a tensor on the device, without reading it back: an
        # asynchronous assertion, which raises PyTorch's RuntimeError.
        error = RuntimeError if BACKEND == "torch" else ValueError
    elif bad == "vector":
        bad = keras.ops.convert_to_tensor([1.0, 2.0])
    grads = gradients(model, x, y)
    with pytest.raises(error, match="`weight`"):
        if entry == "apply":
            opt.apply(grads, model.trainable_variables, weight=bad)
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables), weight=bad)


# The cycle's counters: int64 on TensorFlow, int32 on JAX and PyTorch.
COUNTER_MAX = 2**63 - 1 if BACKEND == "tensorflow" else 2**31 - 1


@pytest.mark.parametrize("too_large", [COUNTER_MAX + 1, 2**64])
def test_n_above_what_the_counters_hold_is_refused_by_name(too_large):
    with pytest.raises(ValueError, match=f"`n` must be at most {COUNTER_MAX}.*n={too_large}"):
        accumulate(keras.optimizers.SGD(), too_large)
    assert accumulate(keras.optimizers.SGD(), COUNTER_MAX).n == COUNTER_MAX


def test_setting_n_above_the_counters_changes_nothing():
    x, y = make_data(32)
    ref = train_steps(make_mlp(), keras.optimizers.Adam(1e-2), split(x, y, 8))
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    batches = split(x, y, 4)
    train_steps(model, opt, batches[:3])
    before = full_state(model, opt)
    with pytest.raises(ValueError, match=f"`n` must be at most {COUNTER_MAX}"):
        opt.n = COUNTER_MAX + 1
    assert opt.n == 2
    assert_states_equal(before, full_state(model, opt))
    assert_states_close(ref, train_steps(model, opt, batches[3:]))


def test_a_schedule_above_the_counters_is_refused_by_name():
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), n=lambda applied: COUNTER_MAX + 1)
    x, y = make_data(4)
    with pytest.raises(ValueError, match=f"schedule returned {COUNTER_MAX + 1}.*`n` must be at most"):
        opt.apply(gradients(model, x, y), model.trainable_variables)
    with pytest.raises(ValueError, match="`max_n`.*`n` must be at most"):
        gradaccum.schedules.from_noise_scale(2, COUNTER_MAX + 1)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_callback_flags_are_booleans(bad):
    with pytest.raises(TypeError, match="`estimates` must be True.*or False"):
        gradaccum.callbacks.GradientNoiseScale(estimates=bad)


@pytest.mark.parametrize("bad, error", [(2.5, TypeError), ("2", ValueError), (0, ValueError)])
def test_callback_arguments_are_checked_by_name(bad, error):
    with pytest.raises(error, match="`update_freq`"):
        gradaccum.callbacks.GradientNoiseScale(update_freq=bad)
    with pytest.raises(TypeError, match="`at` must be a string"):
        gradaccum.callbacks.FlushPartialCycle(at=1)


def test_follow_refuses_swapped_arguments_by_name():
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(), 2)
    with pytest.raises(TypeError, match="`model` must be a Keras model"):
        gradaccum.layers.follow(opt, model)
    with pytest.raises(TypeError, match="`optimizer` must be a Keras optimizer"):
        gradaccum.layers.follow(model, "sgd")
    gradaccum.layers.follow(model, opt)  # the right order
