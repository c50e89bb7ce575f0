"""Behaviours Keras's own optimizer tests check, against Keras's reference.

- Variables marked `overwrite_with_gradient` (float8 scales and amax
  histories) take the cycle's maximum value on the apply step, as under
  Keras's own `gradient_accumulation_steps`.
- A float8-quantized model saved as `.keras` loads again (its variables are
  listed in another order once reloaded).
- The optimizer pickles and copies as a Keras optimizer does.
- With `use_ema=True`, a `fit` shorter than one cycle leaves the weights as
  they are; longer ones finalize what large-batch training finalizes.
"""

import copy
import os
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import (
    ATOL,
    RTOL,
    assert_states_close,
    assert_states_equal,
    fit,
    fit_pair,
    full_state,
    gradients,
    make_data,
    make_float8_model,
    make_mlp,
    model_state,
    without_keras_accumulation,
)
from tests.helpers.distribute import mirrored

B = 4  # micro-batch size


# ----------------------------------------------------------------------
# A float8 model saved as `.keras` loads again, and resumes mid-cycle (its
# cycle maxima in fit: tests/keras_parity/test_overwrite_with_gradient.py).


F8_N, F8_CYCLES = 4, 3
F8_X, F8_Y = make_data(B * F8_N * F8_CYCLES, in_dim=8, out_dim=4)


def _fit_float8(optimizer, batch_size, x=F8_X, y=F8_Y):
    return fit(make_float8_model(), optimizer, x, y, batch_size)


@pytest.mark.parametrize("n", [1, 2])
def test_float8_keras_file_loads_and_resumes(tmp_path, n):
    stop = 3  # micro-batches before the save: mid-cycle for n=2
    # Keras's option cannot load such a file itself; it trains uninterrupted.
    reference_opt = keras.optimizers.Adam(
        1e-2, **({"gradient_accumulation_steps": n} if n > 1 else {})
    )
    reference = _fit_float8(reference_opt, B)

    opt = accumulate(keras.optimizers.Adam(1e-2), n)
    model = _fit_float8(opt, B, F8_X[: stop * B], F8_Y[: stop * B])
    path = os.path.join(tmp_path, "float8.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    opt = restored.optimizer
    assert isinstance(opt, AccumulatingOptimizer)
    assert int(opt.micro_step) == stop % n
    restored.fit(F8_X[stop * B :], F8_Y[stop * B :], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(
        without_keras_accumulation(full_state(reference, reference_opt)),
        without_keras_accumulation(full_state(restored, opt)),
    )


def test_accumulator_shape_mismatch_names_the_variable():
    x, y = make_data(B * 2)
    saved = fit(make_mlp(widths=(8,)), accumulate(keras.optimizers.SGD(0.1), 2), x, y, B)
    store = {}
    saved.optimizer.save_own_variables(store)
    other = make_mlp(widths=(6,))  # the same variable names, other shapes
    opt = accumulate(keras.optimizers.SGD(0.1), 2)
    opt.build(other.trainable_variables)
    with pytest.raises(ValueError, match="hidden0/kernel"):
        opt.load_own_variables(store)


# ----------------------------------------------------------------------
# Pickling and copying, as Keras optimizers do.


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


COPIERS = {"pickle": _pickled, "copy": copy.copy, "deepcopy": copy.deepcopy}


@pytest.mark.parametrize(
    "copier, mode, loss_scale",
    [(copier, "masked", loss_scale) for copier in sorted(COPIERS) for loss_scale in (False, True)]
    # The mode is carried like `n` and `reduction`.
    + [(copier, "skip", False) for copier in sorted(COPIERS)],
)
def test_copies_of_a_trained_optimizer_are_what_keras_copies(copier, mode, loss_scale):
    copier = COPIERS[copier]

    def adam():
        opt = keras.optimizers.Adam(1e-2)
        return keras.optimizers.LossScaleOptimizer(opt) if loss_scale else opt

    x, y = make_data(B * 3 * 2)
    plain = adam()
    fit(make_mlp(), plain, x, y, B * 3)
    opt = accumulate(adam(), 3, reduction="sum", mode=mode)
    fit(make_mlp(), opt, x, y, B)
    assert int(opt.iterations) == int(plain.iterations) == 2

    expected = copier(plain)
    copied = copier(opt)
    assert isinstance(copied, AccumulatingOptimizer)
    assert type(copied.__wrapped__) is type(expected)
    assert (copied.n, copied.reduction, copied.mode) == (3, "sum", mode)
    # As Keras's `test_pickleable_optimizers` checks: the same config.
    assert expected.get_config() == plain.get_config()
    assert copied.get_config() == opt.get_config()
    assert copied.built == expected.built
    assert int(copied.iterations) == int(expected.iterations)
    assert int(copied.micro_step) == 0
    assert int(opt.iterations) == 2  # the original is untouched


@pytest.mark.parametrize("copier", sorted(COPIERS))
def test_copies_train_as_the_large_batch(copier):
    copier = COPIERS[copier]
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2),
        n=3,
        micro_batch=B,
        cycles=2,
        wrap=lambda opt, n: copier(accumulate(opt, n)),
    )
    assert acc["iterations"] == 2
    assert_states_close(ref, acc)


@pytest.mark.parametrize("copier", sorted(COPIERS))
def test_copies_around_a_loss_scale_optimizer_train_as_the_large_batch(copier):
    copier = COPIERS[copier]
    x, y = make_data(B * 3 * 2)
    reference = fit(make_mlp(), keras.optimizers.Adam(1e-2), x, y, B * 3)
    opt = copier(
        accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), 3)
    )
    assert isinstance(opt, AccumulatingOptimizer)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert opt.n == 3
    model = fit(make_mlp(), opt, x, y, B)
    assert int(opt.iterations) == 2
    reference_weights, weights = model_state(reference), model_state(model)
    assert sorted(reference_weights) == sorted(weights)
    for key in reference_weights:
        np.testing.assert_allclose(
            weights[key], reference_weights[key], rtol=RTOL, atol=ATOL, err_msg=key
        )


# ----------------------------------------------------------------------
# EMA: nothing is finalized from a moving average no update has reached.

EMA_N = 2


def _ema_adam(frequency, **kwargs):
    return keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=frequency, **kwargs
    )


@pytest.mark.parametrize("frequency", [None, 2])
@pytest.mark.parametrize("batches", [1, 2, 5])  # shorter than, one, and 2.5 cycles
def test_ema_fit_finalizes_what_the_large_batch_finalizes(batches, frequency):
    x, y = make_data(B * batches)
    untouched = make_mlp()
    model = make_mlp()
    opt = accumulate(_ema_adam(frequency), EMA_N)
    fit(model, opt, x, y, B)
    applied = batches // EMA_N
    assert int(opt.iterations) == applied
    if applied == 0:
        # No update has been applied: the weights stay as they were, as
        # under Keras's own `gradient_accumulation_steps`.
        assert_states_equal(model_state(untouched), model_state(model))
        keras_opt = _ema_adam(frequency, gradient_accumulation_steps=EMA_N)
        keras_model = fit(make_mlp(), keras_opt, x, y, B)
        assert_states_equal(model_state(keras_model), model_state(model))
        return
    # The large batch over the applied cycles; a partial cycle after them is
    # not applied (it waits for the next `fit`).
    used = applied * EMA_N * B
    reference_opt = _ema_adam(frequency)
    reference = fit(make_mlp(), reference_opt, x[:used], y[:used], EMA_N * B)
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


@pytest.mark.parametrize("wrapping", ["inside", "outside"])
def test_ema_fit_shorter_than_a_cycle_under_loss_scaling(wrapping):
    x, y = make_data(B)
    untouched = make_mlp()
    if wrapping == "inside":
        opt = accumulate(keras.optimizers.LossScaleOptimizer(_ema_adam(None)), EMA_N)
    else:
        opt = keras.optimizers.LossScaleOptimizer(accumulate(_ema_adam(None), EMA_N))
    model = fit(make_mlp(), opt, x, y, B)
    assert int(opt.iterations) == 0
    assert_states_equal(model_state(untouched), model_state(model))


def test_ema_finalized_inside_tf_function():
    x, y = make_data(B * EMA_N)
    model = make_mlp()
    initial = model_state(model)
    opt = accumulate(_ema_adam(None), EMA_N)
    opt.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        grads = gradients(model, xb, yb)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def finalize():
        opt.finalize_variable_values(model.trainable_variables)

    step(x[:B], y[:B])
    finalize()  # no update applied yet: nothing changes
    assert_states_equal(initial, model_state(model))
    step(x[B:], y[B:])
    finalize()

    reference = make_mlp()
    reference_opt = _ema_adam(None)
    reference_opt.apply_gradients(
        zip(gradients(reference, x, y), reference.trainable_variables)
    )
    reference_opt.finalize_variable_values(reference.trainable_variables)
    assert_states_close(full_state(reference, reference_opt), full_state(model, opt))


def test_ema_fit_shorter_than_a_cycle_under_mirrored_strategy():
    x, y = make_data(B)
    untouched = make_mlp()
    with mirrored().scope():
        model = make_mlp()
        opt = accumulate(_ema_adam(None), EMA_N)
        fit(model, opt, x, y, B)
    assert int(opt.iterations.numpy()) == 0
    assert_states_equal(model_state(untouched), model_state(model))
