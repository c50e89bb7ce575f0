"""The TensorFlow update of a cycle: nothing shared between optimizers, and
nothing divided in place where an eager update may raise; on one replica,
an in-between micro-step runs no part of the update.

Two optimizers trained at the same time in two threads must each give what
they give alone (an EMA overwrite in one must not reach the other's
variables that received no gradient). An eager update that raises must
leave the accumulators holding the cycle's sums, so that the step can be
retried.
"""

import collections
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    full_state,
    internal_state,
    make_data,
    make_mlp,
)
from tests.helpers.distribute import distributed_batches, mirrored

N, B, CYCLES = 2, 4, 3


class _WithFrozen(keras.Model):
    """Dense layers in a chain, and beside them as many layers whose output
    only a side loss sees: trained in the first cycle, then frozen (no
    gradient), when weight decay must leave them alone. Many of both, so
    that two threads update at the same time for long."""

    def __init__(self, layers=8):
        super().__init__(name="mlp")
        self.chain = [keras.layers.Dense(4, activation="tanh", name=f"hidden{i}") for i in range(layers)]
        self.out = keras.layers.Dense(3, name="out")
        self.side = [keras.layers.Dense(3, name=f"frozen{i}") for i in range(layers)]

    def call(self, x):
        side = tf.add_n([tf.reduce_mean(tf.square(layer(x)), axis=-1) for layer in self.side])
        for layer in self.chain:
            x = layer(x)
        return self.out(x), side


def _model(layers):
    # Initial weights from a generator of its own: the global seed is
    # shared by threads.
    model = _WithFrozen(layers)
    model(np.zeros((1, 5), "float32"))
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def _ema():
    opt = keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=1)
    overwrite = opt._overwrite_model_variables_with_average_value

    def slow(variables):
        # Once the layers are frozen, widens the time the overwrite takes
        # (eagerly), so that the other thread updates meanwhile.
        if tf.executing_eagerly() and int(opt.iterations.numpy()) >= 1:
            time.sleep(0.3)
        return overwrite(variables)

    opt._overwrite_model_variables_with_average_value = slow
    return opt


def _decayed():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.5)


def _train(strategy, make_optimizer, n, global_batch, barrier=None, eager=False, layers=8, mode="masked"):
    """A custom loop under `strategy` (in a `tf.function` unless `eager`):
    the frozen layers have gradients in the first cycle only. Returns the
    model's and the optimizer's state."""
    x, y = make_data(B * N * CYCLES)
    with strategy.scope():
        model = _model(layers)
        opt = make_optimizer() if n is None else accumulate(make_optimizer(), n, mode=mode)
        opt.build(model.trainable_variables)
    used = [v for v in model.trainable_variables if "/frozen" not in v.path]
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def replica_step(xb, yb, frozen):
        with tf.GradientTape() as tape:
            out, side = model(xb, training=True)
            per_example = loss_fn(yb, out) + (0.0 if frozen else side)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        variables = used if frozen else model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def steps(frozen):
        def step(xb, yb):
            strategy.run(replica_step, args=(xb, yb, frozen))

        return step if eager else tf.function(step)

    first, later = steps(False), steps(True)
    cycle = 1 if n is None else n

    if barrier is not None:
        barrier.wait()
    for i, (xb, yb) in enumerate(distributed_batches(strategy, x, y, global_batch)):
        (first if i < cycle else later)(xb, yb)
    return full_state(model, opt)


def _one_device():
    return tf.distribute.get_strategy()


# Eagerly, where the update runs on every step, the threads meet often (the
# test failed when a global flag was set while an optimizer overwrote its
# variables with their moving averages). Two MirroredStrategies training at
# once in one process can hang in TensorFlow's replica threads once other
# strategies were made in it, so each thread runs on one device here.
@pytest.mark.parametrize("new_strategy, eager, layers, repeats", [(_one_device, True, 8, 4)], ids=["one_device_eager"])
def test_two_optimizers_in_two_threads_each_equal_their_run_alone(new_strategy, eager, layers, repeats):
    """An EMA overwrite in one thread while another optimizer updates must
    not write that optimizer's variables that received no gradient in the
    cycle (nor any other of its variables). Each thread has its own
    strategy."""
    makers = {"ema": _ema, "decayed": _decayed}
    alone = {name: _train(new_strategy(), make, N, B, eager=eager, layers=layers) for name, make in makers.items()}
    # What they are alone is the large batch's result.
    for name, make in makers.items():
        large = _train(tf.distribute.get_strategy(), make, None, B * N, layers=layers)
        assert_states_close(large, {k: v for k, v in alone[name].items() if k in large})

    for _ in range(repeats):
        results = _in_two_threads(new_strategy, makers, eager, layers)
        for name in alone:
            assert_states_equal(alone[name], results[name])


def _in_two_threads(new_strategy, makers, eager, layers):
    """Both optimizers trained at once, each in a thread with its own strategy."""
    results, errors = {}, []
    barrier = threading.Barrier(len(makers))

    def run(name, make):
        try:
            results[name] = _train(new_strategy(), make, N, B, barrier, eager, layers)
        except Exception as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=item) for item in makers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# Classes that override part of Keras's update, which the update cannot split
# (under a strategy that needs merge calls): Nadam its `_backend_update_step`
# (writing a product of every step), Muon its weight decay.
_OVERRIDING = {
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "muon": lambda: keras.optimizers.Muon(1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "replicas, eager", [(1, False), (2, False), (2, True)], ids=["one_device", "mirrored", "mirrored_eager"]
)
@pytest.mark.parametrize("name", sorted(_OVERRIDING))
def test_optimizer_overriding_the_update_leaves_variables_without_gradients_alone(name, replicas, eager, mode):
    """The frozen layers and their slots stay as the large batch leaves
    them, while `iterations` and Nadam's product move, with no warning."""
    make = _OVERRIDING[name]
    large = _train(_one_device(), make, None, B * N, layers=2)
    strategy = mirrored() if replicas == 2 else _one_device()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        subject = _train(strategy, make, N, B, eager=eager, layers=2, mode=mode)
    assert not [str(w.message) for w in caught if "gradaccum" in str(w.message)]
    assert_states_close(large, {k: v for k, v in subject.items() if k in large})


@pytest.mark.parametrize("mode", MODES)
def test_ema_average_of_a_variable_without_gradients_warns_where_updated_by_snapshot(mode):
    """Nadam's update runs whole there: the average of a variable without a
    gradient in the cycle is computed from the variable as updated with the
    gradient 0, so it differs from the large batch's, and the warning names
    it."""
    variables = [keras.Variable(np.ones((2, 2), "float32"), name=name) for name in ("used", "idle")]
    opt = accumulate(keras.optimizers.Nadam(1e-1, use_ema=True), N, mode=mode)
    opt.build(variables)
    grads = [tf.ones((2, 2)), tf.ones((2, 2))]
    for _ in range(N):
        opt.apply(grads, variables)
    with pytest.warns(UserWarning, match="idle_average"):
        for _ in range(N):
            opt.apply([grads[0], None], variables)


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


def _raise_on_apply(mode):
    """Trains `accumulate(Adam, N, mode)` eagerly up to its apply step, whose
    update raises. Returns the state and sums before, after, the models,
    the optimizers, and the last micro-batch's gradients."""
    x, y = make_data(B * N)
    ref_model, model = make_mlp(), make_mlp()
    ref_opt = keras.optimizers.Adam(1e-2)
    ref_opt.apply_gradients(zip(_eager_grads(ref_model, x, y), ref_model.trainable_variables))

    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    batches = [(x[i * B : (i + 1) * B], y[i * B : (i + 1) * B]) for i in range(N)]
    for xb, yb in batches[:-1]:
        opt.apply_gradients(zip(_eager_grads(model, xb, yb), model.trainable_variables))
    before = (full_state(model, opt), _sums(opt))
    inner = opt.__wrapped__
    inner.update_step = _RaisesOnce(inner)
    last = _eager_grads(model, *batches[-1])
    with pytest.raises(RuntimeError, match="injected"):
        opt.apply_gradients(zip(last, model.trainable_variables))
    after = (full_state(model, opt), _sums(opt))
    return before, after, (ref_model, ref_opt), (model, opt), last


def test_eager_masked_update_that_raises_leaves_the_sums_undivided():
    """The masked update divides into new tensors eagerly, as skip does:
    after the raise both hold the same sums, and no variable moved."""
    held = {}
    for mode in MODES:
        before, after, _, _, _ = _raise_on_apply(mode)
        assert_states_equal(before[0], after[0])
        held[mode] = after[1]
    for masked, skipped in zip(held["masked"], held["skip"]):
        np.testing.assert_array_equal(masked, skipped)


@pytest.mark.parametrize("mode", MODES)
def test_eager_update_that_raises_leaves_the_state_and_a_retry_equals_the_large_batch(mode):
    before, after, (ref_model, ref_opt), (model, opt), last = _raise_on_apply(mode)
    assert_states_equal(before[0], after[0])
    for held, expected in zip(after[1], before[1]):
        np.testing.assert_array_equal(held, expected)
    opt.apply_gradients(zip(last, model.trainable_variables))
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def _ops_outside_branches(optimizer, layers):
    """The ops a traced `fit` train step of an MLP of `layers` hidden layers
    runs outside any branch, counted by type."""
    model = make_mlp(widths=(4,) * layers)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = make_data(B)
    model.fit(x, y, batch_size=B, verbose=0)
    traced = tf.function(model.train_step).get_concrete_function((tf.constant(x), tf.constant(y)))
    return collections.Counter(op.type for op in traced.graph.get_operations())


def test_in_between_micro_step_on_one_replica_grows_with_the_variables_as_keras_option_does():
    """Traced on one replica without XLA, the default mode's micro-step runs
    outside its branches no more per variable than Keras's own
    `gradient_accumulation_steps` (whose accumulation is one branch); the
    sums are divided and read inside the branch taken on the apply step,
    and the number of branches does not grow with the variables."""
    ours = {layers: _ops_outside_branches(accumulate(keras.optimizers.Adam(1e-3), N), layers) for layers in (1, 6)}
    reference = {
        layers: _ops_outside_branches(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N), layers)
        for layers in (1, 6)
    }

    def grown(counts):
        return sum(counts[6].values()) - sum(counts[1].values())

    assert grown(ours) <= grown(reference), (ours[6] - ours[1], reference[6] - reference[1])
    assert ours[6]["If"] == ours[1]["If"]


def _fit_one_cycle(mode):
    """One cycle of `fit` (traced, one replica, no XLA) with
    `accumulate(Adam, N, mode)`. Returns the state and the raw accumulators."""
    x, y = make_data(B * N)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return full_state(model, opt), [np.array(a) for a in internal_state(opt).accumulators]


def test_traced_apply_step_on_one_replica_divides_into_new_tensors_as_skip_does():
    """The default mode's apply step on one replica reads the sums and hands
    the optimizer their quotients as new tensors, as skip mode does, rather
    than writing them over the sums: a quotient held by no variable is one
    the optimizer's update may overwrite in place, and the division writes
    no variable. After the cycle both hold the same sums, and the same
    state."""
    masked_state, masked_sums = _fit_one_cycle("masked")
    skip_state, skip_sums = _fit_one_cycle("skip")
    assert_states_close(skip_state, masked_state)
    for masked, skipped in zip(masked_sums, skip_sums, strict=True):
        np.testing.assert_array_equal(masked, skipped)
