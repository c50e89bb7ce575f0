"""The TensorFlow update of a cycle: nothing shared between optimizers, and
nothing divided in place where an eager update may raise.

Two optimizers trained at the same time in two threads must each give what
they give alone (an EMA overwrite in one must not reach the other's
variables that received no gradient). An eager update that raises must
leave the accumulators holding the cycle's sums, so that the step can be
retried.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, assert_states_equal, full_state, make_data, make_mlp
from tests.helpers.distribute import distributed_batches

N, B, CYCLES = 2, 4, 2


class _WithUnused(keras.Model):
    """A Dense MLP beside a layer whose output the loss never sees: the
    layer receives no gradient, so weight decay must leave it alone."""

    def __init__(self):
        super().__init__(name="mlp")
        self.hidden = keras.layers.Dense(4, activation="tanh", name="hidden0")
        self.out = keras.layers.Dense(3, name="out")
        self.unused = keras.layers.Dense(3, name="unused")

    def call(self, x):
        self.unused(x)
        return self.out(self.hidden(x))


def _model():
    keras.utils.set_random_seed(0)
    model = _WithUnused()
    model(np.zeros((1, 5), "float32"))
    return model


def _ema():
    return keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=1)


def _decayed():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.5)


def _train(strategy, make_optimizer, n, global_batch, barrier=None):
    """A custom loop under `strategy`; gradients of the used layers only.
    Returns the model's and the optimizer's state."""
    x, y = make_data(B * N * CYCLES)
    with strategy.scope():
        model = _model()
        opt = make_optimizer() if n is None else accumulate(make_optimizer(), n)
        opt.build(model.trainable_variables)
    used = [v for v in model.trainable_variables if "/unused/" not in v.path]
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        opt.apply_gradients(zip(tape.gradient(loss, used), used))

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    if barrier is not None:
        barrier.wait()
    for xb, yb in distributed_batches(strategy, x, y, global_batch):
        step(xb, yb)
    return full_state(model, opt)


def _two_cpus():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _one_device():
    return tf.distribute.get_strategy()


@pytest.mark.parametrize("new_strategy", [_one_device, _two_cpus], ids=["one_device", "mirrored"])
def test_two_optimizers_in_two_threads_each_equal_their_run_alone(new_strategy):
    """An EMA overwrite traced in one thread while another optimizer traces
    its update must not write that optimizer's variables that received no
    gradient in the cycle (nor any other of its variables). Each thread
    has its own strategy."""
    alone = {name: _train(new_strategy(), make, N, B) for name, make in (("ema", _ema), ("decayed", _decayed))}
    # What they are alone is the large batch's result.
    for name, make in (("ema", _ema), ("decayed", _decayed)):
        large = _train(tf.distribute.get_strategy(), make, None, B * N)
        assert_states_close(large, {k: v for k, v in alone[name].items() if k in large})
    initial = _model().get_weights()
    assert np.array_equal(alone["decayed"]["model/unused/kernel"], initial[-2])

    for _ in range(4):
        results, errors = {}, []
        barrier = threading.Barrier(2)

        def run(name, make):
            try:
                results[name] = _train(new_strategy(), make, N, B, barrier)
            except Exception as error:  # noqa: BLE001 (re-raised below)
                errors.append(error)

        threads = [threading.Thread(target=run, args=item) for item in (("ema", _ema), ("decayed", _decayed))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for name in alone:
            assert_states_equal(alone[name], results[name])


# ----------------------------------------------------------------------
# An eager update that raises leaves the accumulators as they were.


class _RaisesOnce:
    """`update_step` that raises on its first call, then is the optimizer's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.original = optimizer.update_step
        self.raised = False

    def __call__(self, gradient, variable, learning_rate):
        if not self.raised:
            self.raised = True
            raise RuntimeError("injected")
        return self.original(gradient, variable, learning_rate)


def _eager_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _sums(opt):
    return [np.array(a) for a in opt.accumulation_state.accumulators]


@pytest.mark.parametrize("mode", MODES)
def test_eager_update_that_raises_leaves_the_sums_and_a_retry_equals_the_large_batch(mode):
    keras.utils.set_random_seed(0)

    x, y = make_data(B * N)
    ref_model, model = make_mlp(), make_mlp()
    ref_opt = keras.optimizers.Adam(1e-2)
    ref_opt.apply_gradients(zip(_eager_grads(ref_model, x, y), ref_model.trainable_variables))

    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    batches = [(x[i * B : (i + 1) * B], y[i * B : (i + 1) * B]) for i in range(N)]
    for xb, yb in batches[:-1]:
        opt.apply_gradients(zip(_eager_grads(model, xb, yb), model.trainable_variables))
    before, sums = full_state(model, opt), _sums(opt)

    inner = opt.__wrapped__
    inner.update_step = _RaisesOnce(inner)
    last = _eager_grads(model, *batches[-1])
    with pytest.raises(RuntimeError, match="injected"):
        opt.apply_gradients(zip(last, model.trainable_variables))
    assert_states_equal(before, full_state(model, opt))
    for held, expected in zip(_sums(opt), sums):
        np.testing.assert_array_equal(held, expected)

    opt.apply_gradients(zip(last, model.trainable_variables))
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))
