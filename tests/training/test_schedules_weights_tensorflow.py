"""Changing n, weighted (ragged) micro-batches and flushing a partial
cycle, in traced steps, checkpoints and under MirroredStrategy.

References: the plain optimizer applied to the gradient of the large batch
each update is meant to see (its micro-batches concatenated), from the same
initial weights. Eager loops on every backend: `tests/training/test_loops.py`.
"""

import warnings

import keras
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    concat,
    full_state,
    gradients,
    make_data,
    make_mlp,
    split,
    train_steps,
)
from tests.helpers.distribute import mirrored

B = 4


def _adam():
    return keras.optimizers.Adam(1e-2)


def _loss(model, x, y):
    return keras.losses.MeanSquaredError()(y, model(x))


def _reference(updates, make_opt=_adam):
    """Plain optimizer: one update per list of (x, y) micro-batches."""
    return train_steps(make_mlp(), make_opt(), [concat(micro) for micro in updates])


def _micro_batches(sizes, seed=0):
    x, y = make_data(sum(sizes), seed=seed)
    return split(x, y, sizes)


def _traced_step(model, opt, weighted=False):
    # Built first: a tf.function that creates variables traces twice.
    opt.build(model.trainable_variables)
    traces = []

    @tf.function
    def step(x, y, w):
        traces.append(1)
        grads = gradients(model, x, y)
        if weighted:
            opt.apply_gradients(zip(grads, model.trainable_variables), weight=w)
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables))

    return step, traces


# ----------------------------------------------------------------------
# n that changes


def test_schedule_for_n_equals_growing_large_batches_without_retracing():
    micro = _micro_batches([B] * 12)
    # Updates 0 and 1 accumulate 2 micro-batches, the rest 4.
    expected = _reference([micro[0:2], micro[2:4], micro[4:8], micro[8:12]])
    model = make_mlp()
    opt = accumulate(_adam(), n=lambda step: tf.where(step < 2, 2, 4))
    step, traces = _traced_step(model, opt)
    for x, y in micro:
        step(x, y, 1.0)
    assert len(traces) == 1
    assert int(opt.iterations) == 4 and int(opt.micro_step) == 0
    assert_states_close(expected, full_state(model, opt))


def test_setting_n_between_cycles_needs_no_retracing():
    micro = _micro_batches([B] * 7)
    expected = _reference([micro[0:3], micro[3:5], micro[5:7]])
    model = make_mlp()
    opt = accumulate(_adam(), 3)
    step, traces = _traced_step(model, opt)
    for k, (x, y) in enumerate(micro):
        if k == 3:
            opt.n = 2
        step(x, y, 1.0)
    assert opt.n == 2 and len(traces) == 1
    assert_states_close(expected, full_state(model, opt))


def test_a_function_traced_with_n_1_refuses_to_run_once_n_changed():
    """Documented: a trace with n=1 hands gradients straight over whatever `n`
    becomes. Changing `n` warns, and the stale trace then raises before it
    writes anything instead of silently not accumulating; a new trace
    accumulates."""
    micro = _micro_batches([B] * 3)
    expected = _reference([micro[0:1], micro[1:3]])
    model = make_mlp()
    opt = accumulate(_adam(), 1)
    step, _ = _traced_step(model, opt)
    step(*micro[0], 1.0)
    with pytest.warns(RuntimeWarning, match="traced with n=1"):
        opt.n = 2
    before = full_state(model, opt)
    with pytest.raises(tf.errors.InvalidArgumentError, match="traced with n=1"):
        step(*micro[1], 1.0)
    assert_states_equal(before, full_state(model, opt))
    step, traces = _traced_step(model, opt)
    for x, y in micro[1:3]:
        step(x, y, 1.0)
    assert len(traces) == 1
    assert_states_close(expected, full_state(model, opt))


def test_changing_n_warns_only_after_a_trace_with_n_1():
    model = make_mlp()
    eager = accumulate(_adam(), 1)
    eager.apply_gradients(zip(gradients(model, *_micro_batches([B])[0]), model.trainable_variables))
    traced = accumulate(_adam(), 2)
    step, _ = _traced_step(model, traced)
    step(*_micro_batches([B])[0], 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eager.n = 2
        traced.n = 3
        traced.n = 1


@pytest.mark.parametrize("new_n, expected_groups", [(2, [[0, 1], [2, 3]]), (1, [[0, 1, 2], [3]])])
def test_setting_n_mid_cycle_ends_the_cycle_once_it_holds_new_n(new_n, expected_groups):
    """Documented: the cycle ends at the first micro-step holding >= new n."""
    micro = _micro_batches([B] * 4)
    expected = _reference([[micro[k] for k in g] for g in expected_groups])
    model = make_mlp()
    opt = accumulate(_adam(), 3)
    for k, (x, y) in enumerate(micro):
        if k == 2 and new_n == 1:
            opt.n = new_n  # two micro-batches already accumulated
        if k == 1 and new_n == 2:
            opt.n = new_n  # one micro-batch already accumulated
        opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))
    assert_states_close(expected, full_state(model, opt))


def _schedule(step):
    return tf.where(step < 2, 2, 3)


def test_schedule_checkpoint_mid_cycle_resumes_bit_identical(tmp_path):
    """Saved after the schedule switched, in the middle of a cycle of 3."""
    micro = _micro_batches([B] * 8)
    # Cycles of 2, 2, then 3; the last micro-batch is left pending.
    expected = _reference([micro[0:2], micro[2:4], micro[4:7]])

    def run(stop=None, restore=None):
        model, opt = make_mlp(), accumulate(_adam(), n=_schedule)
        step, _ = _traced_step(model, opt)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        start = 0
        if restore:
            ckpt.restore(restore).assert_consumed()
            start = 5
        for x, y in micro[start:stop]:
            step(x, y, 1.0)
        return model, opt, ckpt

    model, opt, _ = run()
    assert int(opt.iterations) == 3 and int(opt.micro_step) == 1
    assert_states_close(expected, full_state(model, opt))
    _, opt_half, ckpt = run(stop=5)
    assert int(opt_half.iterations) == 2 and int(opt_half.micro_step) == 1
    path = ckpt.save(str(tmp_path / "ckpt"))
    model2, opt2, _ = run(restore=path)
    assert int(opt2.micro_step) == 1
    assert_states_equal(full_state(model, opt), full_state(model2, opt2))


def test_schedule_checkpoint_refuses_an_int_n(tmp_path):
    model, opt = make_mlp(), accumulate(_adam(), n=_schedule)
    x, y = make_data(B)
    opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    model2, opt2 = make_mlp(), accumulate(_adam(), 2)
    opt2.build(model2.trainable_variables)
    with pytest.raises(ValueError, match="a schedule"):
        tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)


# ----------------------------------------------------------------------
# Weighted micro-batches


@pytest.mark.parametrize(
    "loop, entry",
    # Eagerly through `apply`: tests/training/test_loops.py.
    [("eager", "apply_gradients"), ("tf_function", "apply_gradients"), ("tf_function", "apply")],
)
def test_ragged_micro_batches_weighted_by_size_equal_the_large_batch(loop, entry):
    sizes = [4, 4, 2, 3, 5, 1]  # two cycles of 3; ragged throughout
    micro = _micro_batches(sizes)
    expected = _reference([micro[0:3], micro[3:6]])
    model = make_mlp()
    opt = accumulate(_adam(), 3)

    def step(x, y, w):
        grads = gradients(model, x, y)
        if entry == "apply":
            opt.apply(grads, model.trainable_variables, weight=w)
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables), weight=w)

    if loop == "tf_function":
        step = tf.function(step)
    for x, y in micro:
        step(x, y, tf.constant(float(len(x))))
    assert_states_close(expected, full_state(model, opt))


def test_weighted_sum_reduction():
    """`sum`: applies sum(w_i * g_i) -- the gradient of sum(w_i * loss_i)."""
    micro = _micro_batches([B] * 3)
    weights = [2.0, 0.5, 1.0]
    model, plain = make_mlp(), keras.optimizers.SGD(1e-2)
    with tf.GradientTape() as tape:
        loss = sum(w * _loss(model, x, y) for w, (x, y) in zip(weights, micro))
    plain.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    expected = full_state(model, plain)

    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(1e-2), 3, reduction="sum")
    for w, (x, y) in zip(weights, micro):
        opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables), weight=w)
    assert_states_close(expected, full_state(model, opt))


def test_weights_through_a_loss_scale_optimizer():
    sizes = [4, 2, 3]
    micro = _micro_batches(sizes)
    expected = _reference([micro])
    model = make_mlp()
    opt = accumulate(keras.optimizers.LossScaleOptimizer(_adam()), 3)
    for x, y in micro:
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_loss(model, x, y))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables), weight=float(len(x)))
    assert_states_close(expected, full_state(model, opt.inner_optimizer))


def test_weighted_checkpoint_mid_cycle_resumes_bit_identical(tmp_path):
    sizes = [4, 2, 3, 1, 4, 2]
    micro = _micro_batches(sizes)

    def run(stop=None, restore=None):
        model, opt = make_mlp(), accumulate(_adam(), 3)
        opt.build(model.trainable_variables)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        start = 0
        if restore:
            ckpt.restore(restore)
            start = 4
        for k in range(start, len(micro) if stop is None else stop):
            x, y = micro[k]
            opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables), weight=len(x))
        return model, opt, ckpt

    model, opt, _ = run()
    expected = full_state(model, opt)
    _, _, ckpt = run(stop=4)
    path = ckpt.save(str(tmp_path / "ckpt"))
    model2, opt2, _ = run(restore=path)
    assert_states_equal(expected, full_state(model2, opt2))


# ----------------------------------------------------------------------
# Flushing a partial cycle, will_apply


def test_flush_applies_the_mean_of_what_was_accumulated():
    micro = _micro_batches([B] * 5)
    expected = _reference([micro[0:3], micro[3:5]])
    model = make_mlp()
    opt = accumulate(_adam(), 3)
    step, _ = _traced_step(model, opt)
    for x, y in micro:
        step(x, y, 1.0)
    assert int(opt.micro_step) == 2
    opt.flush()
    assert int(opt.micro_step) == 0 and int(opt.iterations) == 2
    assert_states_close(expected, full_state(model, opt))
    before = full_state(model, opt)
    opt.flush()  # empty cycle: nothing changes
    assert_states_equal(before, full_state(model, opt))


@pytest.mark.parametrize("at", ["epoch_end", "train_end"])
def test_flush_partial_cycle_callback(at):
    x, y = make_data(B * 5)
    micro = _micro_batches([B] * 5)
    if at == "epoch_end":  # 5 micro-batches an epoch, n=3: 3 + 2 per epoch
        expected = _reference([micro[0:3], micro[3:5]] * 2)
        epochs = 2
    else:
        expected = _reference([micro[0:3], micro[3:5] + micro[0:1], micro[1:4], micro[4:5]])
        epochs = 2
    model = make_mlp()
    opt = accumulate(_adam(), 3)
    model.compile(optimizer=opt, loss="mse")
    model.fit(
        x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[gradaccum.callbacks.FlushPartialCycle(at=at)],
    )
    assert int(opt.micro_step) == 0
    assert_states_close(expected, full_state(model, opt))


def test_flush_callback_rejects_bad_input():
    with pytest.raises(ValueError, match="`at`"):
        gradaccum.callbacks.FlushPartialCycle(at="batch_end")
    model = make_mlp()
    model.compile(optimizer=_adam(), loss="mse")
    x, y = make_data(B)
    with pytest.raises(ValueError, match="accumulating optimizer"):
        model.fit(x, y, batch_size=B, verbose=0,
                  callbacks=[gradaccum.callbacks.FlushPartialCycle()])


# ----------------------------------------------------------------------
# Under MirroredStrategy (two logical CPUs, see conftest.py)


# SGD is linear in the gradient, so any weighting error shows in full (the
# first Adam steps are close to lr * sign(g) and would hide one).
_OPT = lambda: keras.optimizers.SGD(0.1)  # noqa: E731


def _mirrored_run(make_opt, pairs, weighted, before_step=None):
    """Trains on two replicas; `pairs[k]` holds micro-step k's (x, y) per replica.

    Each replica's loss is a Keras mean-reduced loss, which divides its local
    mean by the replica count itself; weighted, each replica passes its own
    micro-batch size. `before_step(k, opt)` runs eagerly before micro-step k.
    """
    strategy = mirrored()
    with strategy.scope():
        model = make_mlp()
        opt = make_opt()
        opt.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        kwargs = {"weight": tf.cast(tf.shape(x)[0], tf.float32)} if weighted else {}
        opt.apply_gradients(zip(grads, model.trainable_variables), **kwargs)

    traces = []

    @tf.function
    def step(x, y):
        traces.append(1)
        strategy.run(replica_step, args=(x, y))

    for k, pair in enumerate(pairs):
        if before_step is not None:
            before_step(k, opt)
        x, y = (
            strategy.experimental_distribute_values_from_function(
                lambda ctx, i=i, pair=pair: pair[ctx.replica_id_in_sync_group][i]
            )
            for i in (0, 1)
        )
        step(x, y)
    return model, opt, len(traces)


def _replica_pairs(sizes):
    """Micro-batches of the given (replica 0, replica 1) sizes, in order."""
    flat = _micro_batches([s for pair in sizes for s in pair])
    return [flat[2 * k : 2 * k + 2] for k in range(len(sizes))]


def _concatenated(cycles):
    return [[m for pair in cycle for m in pair] for cycle in cycles]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flush", [False, True])
def test_weighted_ragged_micro_batches_under_mirrored_strategy(flush, mode):
    """Each replica sees its own ragged micro-batch and passes its size.

    Reference: one device, the concatenation.
    """
    pairs = _replica_pairs([(4, 2), (3, 3), (1, 4), (2, 2), (4, 1)])
    cycles = [pairs[0:3], pairs[3:5]] if flush else [pairs[0:3]]
    expected = _reference(_concatenated(cycles), make_opt=_OPT)
    steps = 5 if flush else 3
    model, opt, _ = _mirrored_run(
        lambda: accumulate(_OPT(), 3, mode=mode), pairs[:steps], weighted=True
    )
    if flush:
        opt.flush()
    assert int(opt.micro_step) == 0
    assert_states_close(expected, full_state(model, opt))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_schedule_for_n_under_mirrored_strategy(weighted, mode):
    """n = 2 for the first update, then 3, read on every replica alike."""
    sizes = [(B, B)] * 8 if not weighted else [(4, 2), (3, 3), (1, 4), (2, 2), (4, 1), (3, 2), (2, 4), (1, 1)]
    pairs = _replica_pairs(sizes)
    expected = _reference(_concatenated([pairs[0:2], pairs[2:5], pairs[5:8]]), make_opt=_OPT)
    model, opt, traces = _mirrored_run(
        lambda: accumulate(_OPT(), n=lambda step: tf.where(step < 1, 2, 3), mode=mode),
        pairs,
        weighted=weighted,
    )
    if not weighted:  # ragged micro-batches retrace per shape
        assert traces == 1
    assert int(opt.iterations.numpy()) == 3 and int(opt.micro_step) == 0
    assert_states_close(expected, full_state(model, opt))


@pytest.mark.parametrize("mode", MODES)
def test_setting_n_between_cycles_under_mirrored_strategy(mode):
    pairs = _replica_pairs([(B, B)] * 7)
    expected = _reference(_concatenated([pairs[0:3], pairs[3:5], pairs[5:7]]), make_opt=_OPT)

    def before_step(k, opt):
        if k == 3:
            opt.n = 2

    model, opt, traces = _mirrored_run(
        lambda: accumulate(_OPT(), 3, mode=mode), pairs, weighted=False, before_step=before_step
    )
    assert traces == 1 and opt.n == 2
    assert int(opt.iterations.numpy()) == 3 and int(opt.micro_step) == 0
    assert_states_close(expected, full_state(model, opt))
