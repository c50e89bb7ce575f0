"""A split train step (`micro_batch_size=m`) whose later micro-batch raises
leaves nothing half-done: the weights, every optimizer variable,
`iterations`, the accumulation state, BatchNormalization's statistics and
the metrics are as before the failed step (`flush()` then has nothing to
apply), and `fit` run again equals plain `fit(batch_size=B)` that never
failed. That is less than plain Keras leaves after a step that fails in
its loss: its statistics of the whole batch, and in a TensorFlow graph also
`iterations` and the metrics' totals, moved on.

Not on JAX: Keras's JAX `fit` leaves the model's variables without values
after an exception in its step, with any optimizer.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import (
    BACKEND,
    assert_states_close,
    assert_states_equal,
    fit,
    full_state,
    make_data,
    make_mlp,
    values,
    whole_state,
)

pytestmark = pytest.mark.skipif(
    BACKEND == "jax",
    reason="Keras's JAX `fit` leaves the model's variables without values after an exception in its "
    "step, with any optimizer (see the micro-batching guide)",
)

B = 8
_MARK = 100.0  # added to a target: that sample's micro-batch fails while failing is on

_EXECUTIONS = {
    "tensorflow": (pytest.param({}, id="graph"), pytest.param({"run_eagerly": True}, id="eager")),
}.get(BACKEND, (pytest.param({}, id="eager"),))


class _Failing:
    """A mean squared error whose micro-batch holding a marked target
    raises while `on` (a run-time assertion in a TensorFlow graph)."""

    def __init__(self):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            self.flag = tf.Variable(False)
        else:
            self.flag = [False]

    def turn(self, on: bool) -> None:
        if BACKEND == "tensorflow":
            self.flag.assign(on)
        else:
            self.flag[0] = on

    def __call__(self, y_true, y_pred):
        marked = y_true > _MARK / 2
        target = keras.ops.where(marked, y_true - _MARK, y_true)
        loss = keras.ops.mean(keras.ops.square(target - y_pred), axis=-1)
        if BACKEND != "tensorflow":
            if self.flag[0] and bool(keras.ops.convert_to_numpy(keras.ops.any(marked))):
                raise ValueError("a marked micro-batch failed")
            return loss
        import tensorflow as tf

        failing = tf.logical_and(self.flag, tf.reduce_any(marked))
        check = tf.debugging.Assert(tf.logical_not(failing), ["a marked micro-batch failed"])
        with tf.control_dependencies([check]):
            return tf.identity(loss)


def _marked_data():
    """3 batches of `B`; the second's second micro-batch of 4 holds a mark."""
    x, y = make_data(3 * B)
    y = y.copy()
    y[B + 6] += _MARK
    return x, y


def _metrics(model) -> list[np.ndarray]:
    return values(model.metrics_variables)


def _fails(model, loss, x, y) -> None:
    loss.turn(True)
    with pytest.raises(Exception, match="marked micro-batch failed"):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    loss.turn(False)


@pytest.mark.parametrize("compile_kwargs", _EXECUTIONS)
def test_failed_micro_batch_changes_nothing_and_fit_again_equals_plain_fit(compile_kwargs):
    x, y = _marked_data()
    loss = _Failing()
    plain_model, plain = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(plain_model, plain, x, y, B, loss=loss, metrics=["mae"], **compile_kwargs)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=4)
    fit(model, opt, x[:B], y[:B], B, loss=loss, metrics=["mae"], **compile_kwargs)
    before = whole_state(model, opt)
    _fails(model, loss, x[B : 2 * B], y[B : 2 * B])
    assert_states_equal(before, whole_state(model, opt), "a failed split step")
    opt.flush()
    assert_states_equal(before, whole_state(model, opt), "flush() after a failed split step")
    model.fit(x[B:], y[B:], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(full_state(plain_model, plain), full_state(model, opt))


@pytest.mark.parametrize("compile_kwargs", _EXECUTIONS)
def test_failed_micro_batch_puts_back_statistics_and_metrics(compile_kwargs):
    """The first micro-batch wrote BatchNormalization's moving statistics
    and the metrics before the second failed: they are as `fit` began its
    epoch (metrics reset)."""
    x, y = _marked_data()
    loss = _Failing()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(3)])
    opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=4)
    fit(model, opt, x[:B], y[:B], B, loss=loss, metrics=["mae"], **compile_kwargs)
    statistics = values(model.non_trainable_variables)
    before = whole_state(model, opt)
    _fails(model, loss, x[B : 2 * B], y[B : 2 * B])
    assert_states_equal(before, whole_state(model, opt), "a failed split step")
    for value, kept in zip(values(model.non_trainable_variables), statistics):
        np.testing.assert_array_equal(value, kept)
    for value in _metrics(model):
        np.testing.assert_array_equal(value, np.zeros_like(value))
