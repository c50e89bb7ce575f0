"""A TensorFlow step that fails changes nothing (every backend's eager
cases: `tests/atomic_steps/test_atomic_steps.py`).

A `tf.function` runs its ops in data order, not program order: a micro-step
whose loss fails an assertion, or whose gradient the trace left without a
shape and that is not its variable's, must fail before any of its writes
runs, so that the accumulators, counters and weights are as before the
failed call, and the micro-batch run again ends as the large batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.atomic_steps.test_atomic_steps import Injected, fail_once
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    embedding_data,
    fit,
    full_state,
    gradients,
    internal_state,
    make_data,
    make_embedding_model,
    make_mlp,
    split,
    whole_state,
)
from tests.helpers.distribute import mirrored, replica_accumulators, replica_states


def _checked_loss(ok: tf.Variable):
    """Mean squared error, asserting at run time that `ok` holds."""

    def loss(y_true, y_pred):
        check = tf.debugging.Assert(ok, ["the loss's check failed"])
        with tf.control_dependencies([check]):
            return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)

    return loss


@pytest.mark.parametrize("mode", MODES)
def test_fit_step_whose_loss_assertion_fails_changes_nothing(mode):
    x, y = make_data(16)
    ok = tf.Variable(True)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 2, mode=mode)
    fit(model, opt, x[:8], y[:8], 4, loss=_checked_loss(ok))  # a cycle, then a micro-step
    before = whole_state(model, opt)
    ok.assign(False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="check failed"):
        model.fit(x[8:12], y[8:12], batch_size=4, shuffle=False, verbose=0)
    assert_states_equal(before, whole_state(model, opt), "a failed traced step")
    ok.assign(True)
    model.fit(x[8:], y[8:], batch_size=4, shuffle=False, verbose=0)
    reference, plain = make_mlp(), keras.optimizers.Adam(1e-2)
    fit(reference, plain, x, y, 8, loss=_checked_loss(ok))
    assert_states_close(full_state(reference, plain), full_state(model, opt))


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("mode", MODES)
def test_traced_step_with_a_wrong_gradient_shape_changes_nothing(mode, jit):
    """An `input_signature` hides the gradients' shapes from the trace: one
    of the wrong shape fails at run time (under XLA, when compiled for it),
    before anything is written."""
    x, y = make_data(16)
    batches = split(x, y, 4)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 2, mode=mode)
    opt.build(model.trainable_variables)
    unknown = [tf.TensorSpec(None, tf.float32)] * len(model.trainable_variables)

    @tf.function(input_signature=[unknown], jit_compile=jit)
    def step(grads):
        opt.apply(grads, model.trainable_variables)

    for xb, yb in batches[:3]:
        step(gradients(model, xb, yb))
    before = whole_state(model, opt)
    grads = gradients(model, *batches[3])
    wrong = [tf.transpose(grads[0]), *grads[1:]]
    with pytest.raises(tf.errors.InvalidArgumentError):
        step(wrong)
    assert_states_equal(before, whole_state(model, opt), "a traced step with a wrong shape")
    step(grads)
    reference, plain = make_mlp(), keras.optimizers.Adam(1e-2)
    plain.build(reference.trainable_variables)
    for k in (0, 2):
        xb, yb = x[4 * k : 4 * k + 8], y[4 * k : 4 * k + 8]
        plain.apply(gradients(reference, xb, yb), reference.trainable_variables)
    assert_states_close(full_state(reference, plain), full_state(model, opt))


def test_checkpoint_of_another_n_is_refused_before_any_weight_is_written(tmp_path):
    x, y = make_data(12)
    saved = make_mlp()
    fit(saved, accumulate(keras.optimizers.Adam(1e-2), 4), x, y, 4)
    path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).write(str(tmp_path / "n4"))
    model = make_mlp(seed=1)
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    fit(model, opt, x, y, 4)
    before = whole_state(model, opt)
    with pytest.raises(ValueError, match="n=4"):
        tf.train.Checkpoint(model=model, optimizer=opt).read(path)
    assert_states_equal(before, whole_state(model, opt), "a refused checkpoint")


def _held(strategy, model, opt):
    """Every replica's copy of the weights, the optimizer's variables and
    the accumulators, the counters, and the kept slices."""
    kept = {i: k.saved() for i, k in internal_state(opt).kept.items()}
    if strategy.num_replicas_in_sync == 1:
        return [full_state(model, opt)], [], whole_state(model, opt), kept
    return replica_states(strategy, model, opt), replica_accumulators(strategy, opt), whole_state(model, opt), kept


def _assert_held_equal(before, after):
    for one, other in zip(before[0], after[0]):
        assert_states_equal(one, other, "a replica's variables after a failed apply step")
    for one, other in zip(before[1], after[1]):
        for a, b in zip(one, other):
            np.testing.assert_array_equal(a, b)
    assert_states_equal(before[2], after[2], "the counters after a failed apply step")
    assert sorted(before[3]) == sorted(after[3])
    for i in before[3]:
        assert_states_equal(before[3][i], after[3][i], "kept slices after a failed apply step")


@pytest.mark.parametrize(
    "replicas, kind",
    [
        (2, "dense"),
        (1, "slices"),
        (2, "slices"),
    ],
    ids=["two_replicas_dense", "one_device_slices", "two_replicas_slices"],
)
@pytest.mark.parametrize("mode", MODES)
def test_failed_eager_apply_step_changes_nothing(mode, replicas, kind):
    """`fit(run_eagerly=True)`, on one device or a two-replica
    MirroredStrategy: the wrapped update raises on the apply step; every
    replica's weights, optimizer state and accumulators, the counters and
    (an Embedding's `tf.IndexedSlices`, `sparse="auto"`) the kept slices are
    as before, and the micro-batch fitted again ends as the large batch on
    one device."""
    n, batch = 2, 4
    if kind == "slices":
        make = lambda: make_embedding_model(vocab=40)  # noqa: E731
        x, y = embedding_data(batch * n, 2, unique_per_cycle=True)
    else:
        make = make_mlp
        x, y = make_data(batch * n * 2)
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    with strategy.scope():
        model = make()
        opt = accumulate(keras.optimizers.Adam(1e-2), n, mode=mode)
    fit(model, opt, x[: batch * (n + 1)], y[: batch * (n + 1)], batch, run_eagerly=True)
    if kind == "slices":
        assert internal_state(opt).kept, "no slices kept"
    before = _held(strategy, model, opt)
    fail_once(opt)
    last = slice(batch * (n + 1), batch * (n + 2))
    with pytest.raises(Injected):
        model.fit(x[last], y[last], batch_size=batch, shuffle=False, verbose=0)
    _assert_held_equal(before, _held(strategy, model, opt))
    model.fit(x[last.start :], y[last.start :], batch_size=batch, shuffle=False, verbose=0)
    reference, plain = make(), keras.optimizers.Adam(1e-2)
    fit(reference, plain, x, y, batch * n, run_eagerly=True)
    assert_states_close(full_state(reference, plain), full_state(model, opt))


@pytest.mark.parametrize("replicas", [1, 2], ids=["one_device", "two_replicas"])
def test_failed_eager_apply_step_that_tells_the_kind_of_slices_changes_nothing(replicas):
    """`fit(run_eagerly=True)` with an Embedding's `tf.IndexedSlices`
    (`sparse="auto"`): the first cycle's apply step, whose index set tells
    that the slices grow with the batch, fails in the wrapped update; the
    kept slices and every replica's state are as before, and the
    micro-batch fitted again ends as the large batch on one device."""
    n, batch = 2, 4
    make = lambda: make_embedding_model(vocab=40)  # noqa: E731
    x, y = embedding_data(batch * n, 2, unique_per_cycle=True)
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    with strategy.scope():
        model = make()
        opt = accumulate(keras.optimizers.Adam(1e-2), n)
    fit(model, opt, x[:batch], y[:batch], batch, run_eagerly=True)
    before = _held(strategy, model, opt)
    fail_once(opt)
    with pytest.raises(Injected):
        model.fit(x[batch : 2 * batch], y[batch : 2 * batch], batch_size=batch, shuffle=False, verbose=0)
    _assert_held_equal(before, _held(strategy, model, opt))
    model.fit(x[batch:], y[batch:], batch_size=batch, shuffle=False, verbose=0)
    reference, plain = make(), keras.optimizers.Adam(1e-2)
    fit(reference, plain, x, y, batch * n, run_eagerly=True)
    assert_states_close(full_state(reference, plain), full_state(model, opt))
