"""Training code we do not own, and the usual Keras callbacks."""

import threading

import keras
import numpy as np
import pytest

import gradaccum
from gradaccum import AccumulatingOptimizer, accumulate, accumulating
from tests import third_party_trainer
from tests.support import assert_states_close, full_state, make_data

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
    original = keras.Model.compile
    with accumulating(n=N):
        model, _ = third_party_trainer.train(X, Y, B, optimizer=make())
    assert keras.Model.compile is original  # restored on exit
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
    with pytest.raises(ValueError, match="`n`"):
        with accumulating(n=0):
            pass
    with pytest.raises(ValueError, match="`reduction`"):
        with accumulating(n=2, reduction="max"):
            pass
    with pytest.raises(ValueError, match="`mode`"):
        with accumulating(n=2, mode="fast"):
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
