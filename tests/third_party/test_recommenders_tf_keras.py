"""tensorflow-recommenders: a retrieval `tfrs.Model`, trained by its own `train_step`.

tfrs's `Retrieval` task sums its loss over the batch, so the optimizer is
`accumulate(..., reduction="sum")`. Its negatives are the other candidates of
the same batch: a micro-batch has fewer than the large batch, so no
accumulation equals `fit` on the large batch itself. What accumulation
computes is one update from the sum of the micro-batches' losses; the
reference computes exactly that with the plain optimizer, in one step on
the large batch, by scoring each block of `B` examples against its own
candidates (`blocks=N`). Users and items repeat within a batch, so the
embeddings' gradients are `tf.IndexedSlices` with repeated rows; tf_keras's
optimizers sum repeated rows before their update (unlike Keras 3's; only
their clipping sees the slices), so either `sparse` setting equals the
reference here.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs
import tf_keras

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, assert_states_equal, full_state

N, B, CYCLES = 3, 4, 3
USERS, ITEMS = 6, 8


class TwoTower(tfrs.Model):
    def __init__(self, blocks: int = 1):
        super().__init__()
        self.blocks = blocks
        self.user_model = tf_keras.layers.Embedding(USERS, 4, name="users")
        self.item_model = tf_keras.layers.Embedding(ITEMS, 4, name="items")
        self.task = tfrs.tasks.Retrieval()  # reduction SUM, in-batch negatives

    def compute_loss(self, features, training=False):
        if isinstance(features, tuple):  # `train_on_batch(x)` hands over `(x,)`
            (features,) = features
        users = tf.split(self.user_model(features["user"]), self.blocks)
        items = tf.split(self.item_model(features["item"]), self.blocks)
        return tf.add_n([self.task(u, i, compute_metrics=False) for u, i in zip(users, items)])


def _data():
    rng = np.random.default_rng(0)
    return {
        "user": rng.integers(0, USERS, size=B * N * CYCLES).astype("int32"),
        "item": rng.integers(0, ITEMS, size=B * N * CYCLES).astype("int32"),
    }


def _model(blocks=1):
    tf_keras.utils.set_random_seed(0)
    return TwoTower(blocks)


def _train(optimizer, batch_size, blocks=1):
    model = _model(blocks)
    model.compile(optimizer=optimizer)
    model.fit(_data(), batch_size=batch_size, shuffle=False, verbose=0)
    return full_state(model, model.optimizer)


def _adam():
    return tf_keras.optimizers.Adam(0.05)


def test_the_task_sums_and_rows_repeat():
    assert tfrs.tasks.Retrieval()._loss.reduction == tf_keras.losses.Reduction.SUM
    data = _data()
    assert all(len(np.unique(v[: B * N])) < B * N for v in data.values())


@pytest.mark.parametrize("sparse", ["rows", "slices"])
@pytest.mark.parametrize("mode", MODES)
def test_retrieval_equals_one_step_on_the_summed_losses(mode, sparse):
    reference = _train(_adam(), B * N, blocks=N)
    state = _train(accumulate(_adam(), N, reduction="sum", mode=mode, sparse=sparse), B)
    assert int(state["iterations"]) == CYCLES
    assert_states_close(reference, state)


def test_mean_reduction_would_be_n_times_too_small():
    reference = _train(tf_keras.optimizers.SGD(0.1), B * N, blocks=N)
    mean = _train(accumulate(tf_keras.optimizers.SGD(0.1), N), B)
    with pytest.raises(AssertionError):
        assert_states_close(reference, mean)
    total = _train(accumulate(tf_keras.optimizers.SGD(0.1), N, reduction="sum"), B)
    assert_states_close(reference, total)


def test_in_between_steps_change_nothing():
    data = _data()
    model = _model()
    model.compile(optimizer=accumulate(_adam(), N, reduction="sum", sparse="slices"))
    model.fit({k: v[: B * N] for k, v in data.items()}, batch_size=B, shuffle=False, verbose=0)
    before = full_state(model, model.optimizer)
    for k in range(1, N):
        model.train_on_batch({key: v[B * N + (k - 1) * B : B * N + k * B] for key, v in data.items()})
        assert_states_equal(before, full_state(model, model.optimizer))
