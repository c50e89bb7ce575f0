"""`gradaccum.accumulating()` around tf_keras training code.

Models compiled inside the block, compiled before it and fit inside it, with
a summed loss compiled or computed in a custom `train_step` (as
tensorflow-recommenders' retrieval task does); each compared with the plain
optimizer on the large batch.
"""


import pytest
import tensorflow as tf
import tf_keras

from gradaccum import AccumulatingOptimizer, accumulating
from tests.helpers import MODES, assert_states_close, full_state, make_data, make_mlp
from tests.helpers.processes import run_python

N, B = 3, 4
X, Y = make_data(B * N * 4)

MAKERS = [
    pytest.param(lambda: tf_keras.optimizers.Adam(1e-2), id="new"),
    pytest.param(lambda: tf_keras.optimizers.legacy.Adam(1e-2), id="legacy"),
    pytest.param(lambda: "adam", id="name"),
]


def _compiled(optimizer, loss="mse"):
    model = make_mlp()
    model.compile(optimizer=optimizer, loss=loss)
    return model


def _fit(model, batch_size):
    model.fit(X, Y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def _assert_accumulates(model, reference, n=N):
    assert issubclass(type(model.optimizer), AccumulatingOptimizer)
    assert model.optimizer.n == n
    assert int(model.optimizer.iterations) == len(X) // (B * N)
    assert_states_close(
        full_state(reference, reference.optimizer), full_state(model, model.optimizer)
    )


@pytest.mark.parametrize("make", MAKERS)
def test_block_wraps_what_tf_keras_compile_receives(make):
    reference = _fit(_compiled(make()), B * N)
    original = tf_keras.Model.compile
    with accumulating(n=N):
        model = _fit(_compiled(make()), B)
    assert tf_keras.Model.compile is original  # restored on exit
    _assert_accumulates(model, reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", MAKERS[:2])
def test_fit_in_the_block_accumulates_a_tf_keras_model_compiled_before_it(make, mode):
    reference = _fit(_compiled(make()), B * N)
    model = _compiled(make())
    with accumulating(n=N, mode=mode):
        _fit(model, B)
    assert model.optimizer.mode == mode
    _assert_accumulates(model, reference)


def test_compiled_tf_keras_loss_that_sums():
    def loss():
        return tf_keras.losses.MeanSquaredError(reduction="sum")

    reference = _fit(_compiled(tf_keras.optimizers.SGD(1e-3), loss()), B * N)
    with accumulating(n=N):
        model = _fit(_compiled(tf_keras.optimizers.SGD(1e-3), loss()), B)
    assert model.optimizer.reduction == "sum"
    _assert_accumulates(model, reference)


class _SummedLossModel(tf_keras.Model):
    """A model with its own `train_step` and a loss summed over the batch, as
    tensorflow-recommenders' retrieval task has: `compile` sees no loss."""

    def __init__(self):
        super().__init__()
        self.mlp = make_mlp()

    def call(self, x, training=False):
        return self.mlp(x, training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_custom_train_step_with_a_summed_loss_needs_sum():
    def trained(batch_size, n=None, reduction=None):
        model = _SummedLossModel()
        if n is None:
            model.compile(optimizer=tf_keras.optimizers.SGD(1e-3))
            return _fit(model, batch_size)
        with accumulating(n=n, reduction=reduction):
            model.compile(optimizer=tf_keras.optimizers.SGD(1e-3))
            return _fit(model, batch_size)

    reference = trained(B * N)
    _assert_accumulates(trained(B, N, "sum"), reference)
    # The default follows the compiled loss; there is none here, so it takes
    # the mean, and each update is 1/n of the large batch's.
    averaged = trained(B, N)
    assert averaged.optimizer.reduction == "mean"
    with pytest.raises(AssertionError):
        _assert_accumulates(averaged, reference)


def test_tf_keras_imported_inside_the_block(monkeypatch):
    # Without the variable TensorFlow does not import tf_keras itself, so
    # it is first imported inside the block.
    monkeypatch.delenv("TF_USE_LEGACY_KERAS")
    out = run_python(
        """
        import sys
        import gradaccum
        with gradaccum.accumulating(n=2):
            assert "tf_keras" not in sys.modules
            import tf_keras
            model = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            print(isinstance(model.optimizer, tf_keras.optimizers.SGD), model.optimizer.n)
            print(issubclass(type(model.optimizer), gradaccum.AccumulatingOptimizer))
        # Restored on exit: the plain functions, not wrappers around them.
        print(*(type(vars(tf_keras.Model)[name]).__name__ for name in ("compile", "fit")))
        """
    )
    assert out.split() == ["True", "2", "True", "function", "function"]
