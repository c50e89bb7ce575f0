"""keras-rs: a DCN ranking model with its own `train_step`, against the large batch.

A deep-and-cross network (`keras_rs.layers.FeatureCross`) over user and item
embeddings, trained by a `train_step` of its own (the tape, the compiled loss
through `compute_loss`, and `optimizer.apply_gradients`), as recommenders
written on keras-rs do. Users and items repeat within a batch, so the
embeddings' `tf.IndexedSlices` hold repeated rows; with SGD and a
`global_clipnorm` that bites, Keras computes the norm over the slices, which
the default `sparse="auto"` reproduces (and `"rows"` does not).
"""

import keras
import keras_rs
import numpy as np
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import assert_states_close, assert_states_equal, full_state

N, B, CYCLES = 3, 4, 3
USERS, ITEMS = 5, 7


class DCN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.users = keras.layers.Embedding(USERS, 4, name="users")
        self.items = keras.layers.Embedding(ITEMS, 4, name="items")
        self.cross = keras_rs.layers.FeatureCross(name="cross")
        self.deep = keras.layers.Dense(8, activation="relu", name="deep")
        self.rating = keras.layers.Dense(1, name="rating")

    def call(self, inputs):
        x0 = keras.ops.concatenate([self.users(inputs["user"]), self.items(inputs["item"])], axis=-1)
        return self.rating(self.deep(self.cross(x0)))

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            prediction = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=prediction, training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _data(samples=B * N * CYCLES):
    rng = np.random.default_rng(0)
    x = {
        "user": rng.integers(0, USERS, size=samples).astype("int32"),
        "item": rng.integers(0, ITEMS, size=samples).astype("int32"),
    }
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def _model():
    # FeatureCross names its inner Dense itself: start every model from the
    # same name counters, so that both runs' variables carry the same paths.
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = DCN(name="dcn")
    model({"user": np.zeros((1,), "int32"), "item": np.zeros((1,), "int32")})
    return model


def _sgd():
    # Gradient norms here are ~0.5..3: the clip bites on every update.
    return keras.optimizers.SGD(0.1, momentum=0.5, global_clipnorm=0.1)


def _train(optimizer, batch_size):
    x, y = _data()
    model = _model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return full_state(model, model.optimizer)


def test_the_case_under_test():
    """Repeated rows in each embedding's slices; a clip that bites."""
    x, y = _data()
    model = _model()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[: B * N], model({k: v[: B * N] for k, v in x.items()}))
    grads = tape.gradient(loss, model.trainable_variables)
    sparse = [g for g in grads if isinstance(g, tf.IndexedSlices)]
    assert len(sparse) == 2
    assert all(len(np.unique(g.indices)) < len(g.indices) for g in sparse)
    assert float(tf.linalg.global_norm(grads)) > 2 * _sgd().global_clipnorm


def test_own_train_step_equals_the_large_batch():
    reference = _train(_sgd(), B * N)
    state = _train(accumulate(_sgd(), N), B)
    assert int(state["iterations"]) == CYCLES
    assert_states_close(reference, state)


def test_rows_differs_where_the_clip_bites():
    reference = _train(_sgd(), B * N)
    state = _train(accumulate(_sgd(), N, sparse="rows"), B)
    off = max(float(np.max(np.abs(reference[k] - state[k]))) for k in reference)
    assert off > 1e-5
    # Without the clip, SGD is linear in the gradient: rows are exact.
    reference = _train(keras.optimizers.SGD(0.1, momentum=0.5), B * N)
    assert_states_close(reference, _train(accumulate(keras.optimizers.SGD(0.1, momentum=0.5), N, sparse="rows"), B))


def test_in_between_steps_change_nothing():
    x, y = _data()
    model = _model()
    model.compile(optimizer=accumulate(_sgd(), N), loss="mse")
    model.optimizer.build(model.trainable_variables)
    before = full_state(model, model.optimizer)
    for k in range(N - 1):
        model.train_on_batch({key: v[k * B : (k + 1) * B] for key, v in x.items()}, y[k * B : (k + 1) * B])
        assert_states_equal(before, full_state(model, model.optimizer))
    k = N - 1
    model.train_on_batch({key: v[k * B : (k + 1) * B] for key, v in x.items()}, y[k * B : (k + 1) * B])
    assert int(model.optimizer.iterations) == 1
