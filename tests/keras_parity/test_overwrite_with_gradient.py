"""Variables Keras marks `overwrite_with_gradient` (float8 scales and amax
histories) take the cycle's elementwise maximum on every backend, as under
Keras's own `gradient_accumulation_steps`: their "gradient" is their new
value, not a gradient to average."""

from __future__ import annotations

import keras
import numpy as np

from gradaccum import accumulate
from tests.helpers import (
    ATOL,
    RTOL,
    assert_states_close,
    fit,
    full_state,
    make_data,
    make_float8_model,
    values,
    without_keras_accumulation,
)

# Keras's `test_overwrite_with_gradient_with_gradient_accumulation`, with values
# whose maximum differs from both their mean and the last value.
GRADS = [
    np.array([[1.0, 4.0], [2.0, 0.0]], "float32"),
    np.array([[3.0, 1.0], [2.0, 5.0]], "float32"),
    np.array([[0.5, 0.5], [0.5, 0.5]], "float32"),
    np.array([[2.0, 2.0], [6.0, 1.0]], "float32"),
]


def _variables():
    v = keras.Variable([[1.0, 2.0], [3.0, 4.0]], name="overwritten")
    v.overwrite_with_gradient = True
    return v, keras.Variable([[1.0, 2.0], [3.0, 4.0]], name="trained")


def test_the_cycle_maximum_as_keras_takes_it(mode):
    reference = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    ref_variables = _variables()
    reference.build(list(ref_variables))
    opt = accumulate(keras.optimizers.SGD(1.0), 2, mode=mode)
    variables = _variables()
    opt.build(list(variables))
    for k, g in enumerate(GRADS):
        reference.apply([keras.ops.convert_to_tensor(g)] * 2, list(ref_variables))
        opt.apply([keras.ops.convert_to_tensor(g)] * 2, list(variables))
        for got, expected in zip(values(variables), values(ref_variables)):
            np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=str(k))
        assert int(keras.ops.convert_to_numpy(opt.iterations)) == int(keras.ops.convert_to_numpy(reference.iterations))
    # The cycle maxima, not the means (1.5 where Keras's test has 2).
    np.testing.assert_array_equal(values(variables)[0], [[2.0, 2.0], [6.0, 1.0]])


N, B, CYCLES = 4, 4, 3
X, Y = make_data(B * N * CYCLES, in_dim=8, out_dim=4)


def test_float8_dense_in_fit_matches_keras_accumulation(mode):
    reference_opt = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=N)
    reference = fit(make_float8_model(), reference_opt, X, Y, B)
    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    model = fit(make_float8_model(), opt, X, Y, B)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == CYCLES
    assert_states_close(
        without_keras_accumulation(full_state(reference, reference_opt)),
        without_keras_accumulation(full_state(model, opt)),
    )
    # The inputs' scale and amax history depend on the inputs alone: the
    # cycle's maxima are what the large batch records.
    large = fit(make_float8_model(), keras.optimizers.Adam(1e-2), X, Y, B * N)
    weights = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    for w in large.weights:
        if w.path.endswith(("inputs_scale", "inputs_amax_history")):
            np.testing.assert_allclose(
                weights[w.path], keras.ops.convert_to_numpy(w), rtol=RTOL, atol=ATOL, err_msg=w.path
            )
