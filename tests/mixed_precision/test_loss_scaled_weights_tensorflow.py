"""`weight=` in a custom `train_step` whatever wraps what.

Under `mixed_float16`, `compile` wraps the accumulating optimizer in Keras's
`LossScaleOptimizer`; a custom `train_step` that weighs each micro-batch by
its count of valid tokens calls `apply_gradients(..., weight=count)` on that
loss-scale optimizer. The result must be the large batch's: the mean over
every valid token of the cycle.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import assert_states_close, dtype_policy, full_state

N, B, CYCLES, T, VOCAB = 3, 4, 3, 6, 11
# Half-precision rounding, as in test_mixed_precision.py beside this file: the micro-batch and
# large-batch runs round different partial sums to float16's 10-bit mantissa
# (measured there: 2.7e-5 absolute between equivalent runs); a real bug moves
# values by about the learning rate, 1e-2.
FP16_ATOL, FP16_RTOL = 5e-5, 1e-4


class TokenModel(keras.Model):
    """A masked token classifier with the custom `train_step` of a newcomer's
    script: the loss is the mean over valid tokens, and each micro-batch is
    weighted by its count of them."""

    def train_step(self, data):
        x, y = data
        mask = ops.cast(ops.not_equal(y, 0), "float32")
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            per_token = keras.losses.sparse_categorical_crossentropy(y, ops.cast(logits, "float32"), from_logits=True)
            count = ops.sum(mask)
            loss = ops.sum(per_token * mask) / ops.maximum(count, 1.0)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        weighted = isinstance(self.optimizer, AccumulatingOptimizer) or isinstance(
            getattr(self.optimizer, "inner_optimizer", None), AccumulatingOptimizer
        )
        kwargs = {"weight": count} if weighted else {}
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables), **kwargs)
        return {"loss": loss}


def _graph():
    # Dense features per token (an Embedding's sparse gradient is another
    # matter: tests/sparse/test_sparse_tensorflow.py).
    inputs = keras.Input((T, 5))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    return inputs, keras.layers.Dense(VOCAB, name="out")(h)


def _model() -> TokenModel:
    keras.utils.set_random_seed(0)
    inputs, outputs = _graph()
    return TokenModel(inputs, outputs, name="tokens")


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B * N * CYCLES, T, 5)).astype("float32")
    y = rng.integers(1, VOCAB, size=x.shape[:2]).astype("int32")
    lengths = rng.integers(1, T + 1, size=len(y))
    y[np.arange(T)[None, :] >= lengths[:, None]] = 0  # padding: counts differ per micro-batch
    return x, y


def _train(optimizer, batch_size):
    x, y = _data()
    model = _model()
    model.compile(optimizer=optimizer)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return full_state(model, model.optimizer)


def _model_weights(state):
    return {k: v for k, v in state.items() if k.startswith("model/")}


@pytest.mark.parametrize("order", ["lso_accumulate", "accumulate_lso"])
def test_weight_through_a_loss_scale_optimizer_in_float32(order):
    """Explicit wrapping, float32: the tolerance of float32 rounding."""
    lso = keras.optimizers.LossScaleOptimizer
    reference = _train(lso(keras.optimizers.Adam(1e-2)), B * N)
    if order == "lso_accumulate":
        optimizer = lso(accumulate(keras.optimizers.Adam(1e-2), N))
    else:
        optimizer = accumulate(lso(keras.optimizers.Adam(1e-2)), N)
    subject = _train(optimizer, B)
    assert subject["iterations"] == CYCLES
    assert_states_close(_model_weights(reference), _model_weights(subject))


def test_weight_under_mixed_float16_compile():
    """`compile` wraps the accumulating optimizer in a loss-scale optimizer."""
    with dtype_policy("mixed_float16"):
        reference = _train(keras.optimizers.Adam(1e-2), B * N)
        subject = _train(accumulate(keras.optimizers.Adam(1e-2), N), B)
    assert_states_close(_model_weights(reference), _model_weights(subject), rtol=FP16_RTOL, atol=FP16_ATOL)


class UnweightedModel(TokenModel):
    """The same step without `weight=`: every micro-batch weighs alike."""

    def train_step(self, data):
        x, y = data
        mask = ops.cast(ops.not_equal(y, 0), "float32")
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            per_token = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = ops.sum(per_token * mask) / ops.maximum(ops.sum(mask), 1.0)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_unweighted_differs_so_the_weights_matter():
    """Without the weights the cycle's mean of per-micro-batch means is not
    the large batch's (the counts differ): the tests above can fail."""
    reference = _train(keras.optimizers.Adam(1e-2), B * N)
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = UnweightedModel(*_graph(), name="tokens")
    model.compile(optimizer=accumulate(keras.optimizers.Adam(1e-2), N))
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    subject = full_state(model, model.optimizer)
    assert max(np.max(np.abs(subject[k] - reference[k])) for k in _model_weights(reference)) > 1e-4
