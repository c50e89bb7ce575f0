"""Training code we do not own, and the usual Keras callbacks."""

import threading

import keras
import numpy as np
import pytest

from gradaccum import AccumulatingOptimizer, accumulate, accumulating
from tests.helpers import assert_states_close, dtype_policy, full_state, make_data, third_party_trainer

N, B = 3, 4
X, Y = make_data(B * N * 4)


def _reference(optimizer="adam", **kwargs):
    model, history = third_party_trainer.train(X, Y, B * N, optimizer=optimizer, **kwargs)
    return model, history


@pytest.mark.parametrize(
    "optimizer",
    ["adam", {"class_name": "SGD", "config": {"learning_rate": 0.1, "momentum": 0.5}},
     "instance"],
)
def test_accumulating_block_wraps_what_compile_receives(optimizer):
    make = (lambda: keras.optimizers.Nadam(1e-2)) if optimizer == "instance" else (lambda: optimizer)
    ref, _ = _reference(make())
    # What `keras.Model` itself holds (its base's `compile` is wrapped for
    # good by `gradaccum.layers`, so each lookup through the class binds anew).
    original = vars(keras.Model).get("compile")
    with accumulating(n=N):
        model, _ = third_party_trainer.train(X, Y, B, optimizer=make())
    assert vars(keras.Model).get("compile") is original  # restored on exit
    assert issubclass(type(model.optimizer), AccumulatingOptimizer) and model.optimizer.n == N
    assert_states_close(full_state(ref, ref.optimizer), full_state(model, model.optimizer))


def test_compile_default_optimizer_is_wrapped_too():
    model = third_party_trainer.build()
    with accumulating(n=2):
        model.compile(loss="mse")
    assert issubclass(type(model.optimizer), AccumulatingOptimizer)
    assert isinstance(model.optimizer, keras.optimizers.RMSprop)


def test_outside_the_block_compile_is_untouched():
    with accumulating(n=2):
        pass
    model = third_party_trainer.build()
    model.compile(optimizer="adam", loss="mse")
    assert type(model.optimizer) is not AccumulatingOptimizer


def test_nested_blocks_innermost_wins_and_already_accumulating_is_kept():
    model = third_party_trainer.build()
    with accumulating(n=2):
        with accumulating(n=5, reduction="sum", mode="skip"):
            model.compile(optimizer="adam", loss="mse")
            assert (model.optimizer.n, model.optimizer.reduction) == (5, "sum")
            assert model.optimizer.mode == "skip"
        model.compile(optimizer="adam", loss="mse")
        assert (model.optimizer.n, model.optimizer.mode) == (2, "masked")
        own = accumulate(keras.optimizers.Adam(), 7)
        model.compile(optimizer=own, loss="mse")
        assert model.optimizer is own and own.n == 7
        lso = keras.optimizers.LossScaleOptimizer(accumulate(keras.optimizers.Adam(), 3))
        model.compile(optimizer=lso, loss="mse")
        assert model.optimizer is lso


# ----------------------------------------------------------------------
# `fit` of a model compiled before the block


def _fit(model, batch_size, x=X, y=Y):
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def test_fit_in_the_block_accumulates_a_model_compiled_before_it():
    """A keras-hub task compiles in its constructor: built outside the block
    and fit inside, it accumulates as if it had been compiled inside (in the
    mode the block names)."""
    mode = "skip"
    ref = _fit(third_party_trainer.Task(optimizer=keras.optimizers.Nadam(1e-2)), B * N)
    task = third_party_trainer.Task(optimizer=keras.optimizers.Nadam(1e-2))
    with accumulating(n=N, mode=mode):
        _fit(task, B)
    assert issubclass(type(task.optimizer), AccumulatingOptimizer)
    assert (task.optimizer.n, task.optimizer.mode) == (N, mode)
    assert int(task.optimizer.iterations) == len(X) // (B * N)
    assert_states_close(full_state(ref, ref.optimizer), full_state(task, task.optimizer))


def test_fit_in_the_block_retraces_a_model_trained_before_it():
    """Trained (optimizer built, train function traced) before the block:
    the optimizer keeps its state and the train function is traced anew."""
    half = len(X) // 2
    ref = third_party_trainer.Task(optimizer=keras.optimizers.Adam(1e-2))
    _fit(ref, B, X[:half], Y[:half])
    _fit(ref, B * N, X[half:], Y[half:])
    task = third_party_trainer.Task(optimizer=keras.optimizers.Adam(1e-2))
    # The same batch shape before and inside the block: nothing but the new
    # optimizer makes the train function trace again.
    _fit(task, B, X[:half], Y[:half])
    with accumulating(n=N):
        _fit(task, B, X[half:], Y[half:])
    assert int(task.optimizer.iterations) == half // B + half // (B * N)
    assert_states_close(full_state(ref, ref.optimizer), full_state(task, task.optimizer))


def test_fit_in_the_block_under_mixed_precision():
    """compile wrapped the optimizer in a LossScaleOptimizer before the
    block; fit accumulates inside it."""
    with dtype_policy("mixed_float16"):
        ref = _fit(third_party_trainer.Task(optimizer=keras.optimizers.Adam(1e-2)), B * N)
        task = third_party_trainer.Task(optimizer=keras.optimizers.Adam(1e-2))
        with accumulating(n=N):
            _fit(task, B)
    assert isinstance(task.optimizer, keras.optimizers.LossScaleOptimizer)
    assert issubclass(type(task.optimizer), AccumulatingOptimizer)
    # float16 rounding, as in tests/mixed_precision/test_mixed_precision_tensorflow.py: ~3e-5 measured,
    # a missing accumulation moves values by ~lr = 1e-2.
    # The loss scale's growth counter counts finite micro-batches (see the
    # README), the large batch's counts batches.
    expected, got = full_state(ref, ref.optimizer), full_state(task, task.optimizer)
    assert int(got.pop("opt/step_counter")) == N * int(expected.pop("opt/step_counter"))
    assert_states_close(expected, got, rtol=1e-4, atol=5e-5)


def test_model_wrapped_by_fit_saves_and_reloads_accumulating(tmp_path):
    model = third_party_trainer.build()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    with accumulating(n=N):
        _fit(model, B, X[: B * (N + 1)], Y[: B * (N + 1)])  # ends mid-cycle
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert issubclass(type(loaded.optimizer), AccumulatingOptimizer)
    assert loaded.optimizer.n == N and int(loaded.optimizer.micro_step) == 1


def test_fit_outside_the_block_is_untouched():
    task = third_party_trainer.Task()
    with accumulating(n=N):
        pass
    _fit(task, B)
    assert not issubclass(type(task.optimizer), AccumulatingOptimizer)
    assert keras.Model.fit is third_party_trainer.Task.fit


# ----------------------------------------------------------------------
# The compiled loss's reduction


def _sum_mse():
    return keras.losses.MeanSquaredError(reduction="sum")


@pytest.mark.parametrize("compiled", ["inside", "before"])
def test_block_follows_a_loss_that_sums(compiled):
    """A loss summed over the batch needs the summed micro-gradients."""
    ref = _fit(third_party_trainer.Task(optimizer=keras.optimizers.SGD(1e-3), loss=_sum_mse()), B * N)
    if compiled == "before":
        task = third_party_trainer.Task(optimizer=keras.optimizers.SGD(1e-3), loss=_sum_mse())
    with accumulating(n=N):
        if compiled == "inside":
            task = third_party_trainer.Task(optimizer=keras.optimizers.SGD(1e-3), loss=_sum_mse())
        _fit(task, B)
    assert task.optimizer.reduction == "sum"
    assert_states_close(full_state(ref, ref.optimizer), full_state(task, task.optimizer))


def test_block_reduction_given_is_kept_and_a_mismatch_warns():
    model = third_party_trainer.build()
    with accumulating(n=N, reduction="mean"), pytest.warns(UserWarning, match="reduction='mean'.*reduced by 'sum'"):
        model.compile(optimizer="sgd", loss=_sum_mse())
    assert model.optimizer.reduction == "mean"
    model = third_party_trainer.build()
    with accumulating(n=N), pytest.warns(UserWarning, match="optimizer has reduction='mean'.*'sum'"):
        model.compile(optimizer=accumulate(keras.optimizers.SGD(), N), loss=_sum_mse())


def test_block_warns_for_summed_and_averaged_losses_together():
    inputs = keras.Input((5,))
    model = keras.Model(inputs, [keras.layers.Dense(1)(inputs), keras.layers.Dense(1)(inputs)])
    with accumulating(n=N), pytest.warns(UserWarning, match="no single `reduction`"):
        model.compile(optimizer="sgd", loss=[_sum_mse(), "mse"])
    assert model.optimizer.reduction == "mean"


def test_block_applies_to_its_own_thread_only():
    entered, release = threading.Event(), threading.Event()
    results = {}

    def other():
        with accumulating(n=4):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert entered.wait(30)
        model = third_party_trainer.build()
        model.compile(optimizer="adam", loss="mse")  # this thread: no block
        results["here"] = type(model.optimizer)
    finally:
        release.set()
        thread.join(30)
    assert results["here"] is not AccumulatingOptimizer


def test_bad_block_arguments():
    with pytest.raises(ValueError, match="`n`"), accumulating(n=0):
        pass
    with pytest.raises(ValueError, match="`reduction`"), accumulating(n=2, reduction="max"):
        pass
    with pytest.raises(ValueError, match="`mode`"), accumulating(n=2, mode="fast"):
        pass


# ----------------------------------------------------------------------
# Callbacks: each run equals the same callback on the large batch.


def _lr_schedule(epoch, lr):
    return lr * 0.5


CALLBACKS = {
    "learning_rate_scheduler": lambda: keras.callbacks.LearningRateScheduler(_lr_schedule),
    "reduce_lr_on_plateau": lambda: keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=10.0
    ),
    "early_stopping": lambda: keras.callbacks.EarlyStopping(
        monitor="loss", patience=0, min_delta=10.0
    ),
}


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_callbacks_see_what_large_batch_training_shows_them(name):
    ref, ref_history = _reference(keras.optimizers.Adam(1e-2), epochs=3, callbacks=[CALLBACKS[name]()])
    model, history = third_party_trainer.train(
        X, Y, B, optimizer=accumulate(keras.optimizers.Adam(1e-2), N), epochs=3,
        callbacks=[CALLBACKS[name]()],
    )
    assert len(history.history["loss"]) == len(ref_history.history["loss"])
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        float(model.optimizer.learning_rate), float(ref.optimizer.learning_rate), rtol=1e-6
    )
    assert_states_close(full_state(ref, ref.optimizer), full_state(model, model.optimizer))


def _tensorboard_steps(logdir, tag):
    import tensorflow as tf

    steps = []
    for path in tf.io.gfile.glob(f"{logdir}/validation/events.*"):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(steps)


def test_tensorboard_step_counter_is_applied_updates(tmp_path):
    """TensorBoard plots evaluation against `optimizer.iterations`."""
    runs = {}
    for name, optimizer, batch in [
        ("large", keras.optimizers.Adam(1e-2), B * N),
        ("accumulated", accumulate(keras.optimizers.Adam(1e-2), N), B),
    ]:
        logdir = str(tmp_path / name)
        model = third_party_trainer.build()
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(
            X, Y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
            validation_data=(X[:8], Y[:8]),
            callbacks=[keras.callbacks.TensorBoard(logdir)],
        )
        runs[name] = _tensorboard_steps(logdir, "evaluation_loss_vs_iterations")
    per_epoch = len(X) // (B * N)
    assert runs["large"] == [per_epoch, 2 * per_epoch]
    assert runs["accumulated"] == runs["large"]


def test_repr_shows_wrapped_optimizer_n_reduction_and_position():
    model = third_party_trainer.build()
    opt = accumulate(keras.optimizers.Adam(), 3, reduction="sum")
    model.compile(optimizer=opt, loss="mse")
    model.fit(X[:B * 2], Y[:B * 2], batch_size=B, verbose=0)
    text = repr(opt)
    assert "n=3" in text and "reduction='sum'" in text and "micro_step=2" in text
    assert "Adam" in text
