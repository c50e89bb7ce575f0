"""A split train step (`micro_batch_size=m`) whose later micro-batch raises
leaves nothing half-done: the weights, every optimizer variable,
`iterations` and the accumulation state are as before the failed step
(`flush()` then has nothing to apply), and `fit` run again equals plain
`fit(batch_size=B)` that never failed. Where the step runs eagerly,
BatchNormalization's statistics and the metrics the earlier micro-batches
wrote are put back too: less than plain Keras leaves after a step that fails
in its loss (its statistics of the whole batch). In a TensorFlow graph they
keep what ran before the failing op, as plain Keras's step keeps them (and
its `iterations`, which the split step's do not).

Not on JAX: Keras's JAX `fit` leaves the model's variables without values
after an exception in its step, with any optimizer. On every backend, an
exception after the step (a callback's) leaves the step done, and `fit`
continued from the next batch equals plain `fit`.
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

_NOT_ON_JAX = pytest.mark.skipif(
    BACKEND == "jax",
    reason="Keras's JAX `fit` leaves the model's variables without values after an exception in its "
    "step, with any optimizer (see the micro-batching guide)",
)

B = 8
_MARK = 100.0  # added to a target: that sample's micro-batch fails while failing is on

_EXECUTIONS = {
    "tensorflow": (pytest.param({}, id="graph"), pytest.param({"run_eagerly": True}, id="eager")),
}.get(BACKEND, (pytest.param({}, id="eager"),))


@keras.saving.register_keras_serializable(package="tests.micro_batching")
class _Failing(keras.losses.Loss):
    """A mean squared error whose micro-batch holding a marked target
    raises while `turn(True)` holds (a run-time assertion in a TensorFlow
    graph). A file keeps it off."""

    def __init__(self, name="failing", **kwargs):
        super().__init__(name=name, **kwargs)
        if BACKEND == "tensorflow":
            import tensorflow as tf

            self.flag = tf.Variable(False, trainable=False)
        else:
            self.flag = [False]

    def turn(self, on: bool) -> None:
        if BACKEND == "tensorflow":
            self.flag.assign(on)
        else:
            self.flag[0] = on

    def call(self, y_true, y_pred):
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


@_NOT_ON_JAX
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


@_NOT_ON_JAX
@pytest.mark.parametrize(
    "size, compile_kwargs",
    [pytest.param(4, p.values[0], id=f"4-{p.id}") for p in _EXECUTIONS if p.id == "eager"]
    + [pytest.param("auto", p.values[0], id=f"auto-{p.id}") for p in _EXECUTIONS],
)
def test_failed_micro_batch_puts_back_statistics_and_metrics(size, compile_kwargs):
    """Eagerly, the first micro-batch wrote BatchNormalization's moving
    statistics and the metrics before the second failed: they are as `fit`
    began its epoch (metrics reset). `"auto"` keeps them in a graph too."""
    x, y = _marked_data()
    loss = _Failing()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(3)])
    opt = accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=size)
    fit(model, opt, x[:B], y[:B], B, loss=loss, metrics=["mae"], **compile_kwargs)
    statistics = values(model.non_trainable_variables)
    before = whole_state(model, opt)
    _fails(model, loss, x[B : 2 * B], y[B : 2 * B])
    assert_states_equal(before, whole_state(model, opt), "a failed split step")
    for value, kept in zip(values(model.non_trainable_variables), statistics):
        np.testing.assert_array_equal(value, kept)
    for value in _metrics(model):
        np.testing.assert_array_equal(value, np.zeros_like(value))


@_NOT_ON_JAX
def test_keras_file_saved_after_a_failed_split_step_resumes_as_plain_fit(tmp_path):
    x, y = _marked_data()
    plain_model, plain = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(plain_model, plain, x, y, B, loss=_Failing())
    model, loss = make_mlp(), _Failing()
    fit(model, accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=4), x[:B], y[:B], B, loss=loss)
    _fails(model, loss, x[B : 2 * B], y[B : 2 * B])
    path = str(tmp_path / "after_failure.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded.fit(x[B:], y[B:], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(full_state(plain_model, plain), full_state(loaded, loaded.optimizer))


class _Raising(keras.callbacks.Callback):
    """Raises `error` once, at the end of the first batch or at the start
    of the second (between two steps, as an interrupt)."""

    def __init__(self, where, error):
        super().__init__()
        self.where, self.error, self.armed = where, error, True

    def _maybe(self, where, batch):
        if self.armed and where == self.where and batch == (0 if where == "end" else 1):
            self.armed = False
            raise self.error("raised between steps")

    def on_train_batch_end(self, batch, logs=None):
        self._maybe("end", batch)

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe("begin", batch)


@pytest.mark.parametrize("where, error", [("end", ValueError), ("begin", KeyboardInterrupt)])
def test_exception_between_split_steps_leaves_the_step_done(where, error):
    x, y = make_data(3 * B)
    plain_model, plain = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(plain_model, plain, x, y, B)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size=3)
    with pytest.raises(error, match="between steps"):
        fit(model, opt, x, y, B, fit_kwargs={"callbacks": [_Raising(where, error)]})
    state = opt.accumulation_state
    assert (int(opt.iterations), int(state.micro_step), float(state.weight_total)) == (1, 0, 0.0)
    model.fit(x[B:], y[B:], batch_size=B, shuffle=False, verbose=0)
    assert_states_close(full_state(plain_model, plain), full_state(model, opt))
