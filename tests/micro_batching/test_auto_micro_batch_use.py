"""`micro_batch_size="auto"` as users call `fit`: batches of varying size, a
second `fit` with another batch, `evaluate`/`predict` in between, a model
loaded from a file, callbacks, `steps_per_execution` and training code you
do not own. Each run equals plain `fit` on the same batches from the same
initial weights: weights, every optimizer variable, `iterations`, the logs."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

from gradaccum import accumulate, accumulating
from gradaccum._backend.memory import out_of_memory_above
from tests.helpers import (
    BACKEND,
    as_int,
    assert_states_close,
    core_of,
    fit,
    full_state,
    make_data,
    make_mlp,
    third_party_trainer,
)

B = 8


def _batches(x, y, sizes):
    """A generator of the batches of `sizes` samples, in order."""
    def generate():
        start = 0
        for size in sizes:
            yield x[start:start + size], y[start:start + size]
            start += size
    return generate


def _fit_generator(model, opt, x, y, sizes, **compile_kwargs):
    model.compile(optimizer=opt, loss="mse", **compile_kwargs)
    return model.fit(_batches(x, y, sizes)(), steps_per_epoch=len(sizes), shuffle=False, verbose=0).history


@pytest.mark.parametrize(("sizes", "above", "chosen"), (
    ((4, 8, 8, 3), None, 4),
    ((4, 8, 8, 3), 5, 4),
    ((8, 6, 8, 3), 5, 4),
))
def test_batches_of_varying_sizes_equal_plain_fit(sizes, above, chosen):
    """A generator's batches differ in size, the first smaller than later
    ones or the last ragged: each runs in micro-batches of the size chosen
    on the first (the whole of a batch no larger than it)."""
    x, y = make_data(sum(sizes))
    reference, ref_opt = make_mlp(), keras.optimizers.Adam(1e-2)
    ref_history = _fit_generator(reference, ref_opt, x, y, sizes)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    with out_of_memory_above(above) if above else contextlib.nullcontext():
        history = _fit_generator(model, opt, x, y, sizes)
    assert opt.micro_batch_size == chosen
    assert as_int(opt.iterations) == len(sizes)
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


def test_a_second_fit_with_another_batch_equals_plain_fit():
    """The size chosen on the first `fit` is kept for the next: a larger
    batch runs in more micro-batches of it, a smaller one whole;
    `evaluate` and `predict` in between change nothing."""
    x, y = make_data(4 * B)
    runs = []
    for wrap in (lambda o: o, lambda o: accumulate(o, micro_batch_size="auto")):
        model, opt = make_mlp(), wrap(keras.optimizers.Adam(1e-2))
        with out_of_memory_above(4):
            fit(model, opt, x, y, B)
            model.evaluate(x, y, batch_size=2 * B, verbose=0)
            model.predict(x, batch_size=2 * B, verbose=0)
            model.fit(x, y, batch_size=2 * B, shuffle=False, verbose=0)
            model.fit(x[:5], y[:5], batch_size=2, shuffle=False, verbose=0)
        runs.append((full_state(model, opt), model.history.history, opt))
    (reference, ref_history, _), (subject, history, opt) = runs
    assert opt.micro_batch_size == 4
    assert as_int(opt.iterations) == 4 + 2 + 3
    assert_states_close(reference, subject)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


def test_a_loaded_model_trains_on_a_smaller_batch_than_the_size_kept(tmp_path):
    x, y = make_data(4 * B)
    runs = []
    for wrap in (lambda o: o, lambda o: accumulate(o, micro_batch_size="auto")):
        model, opt = make_mlp(), wrap(keras.optimizers.Adam(1e-2))
        with out_of_memory_above(4):
            fit(model, opt, x, y, B)
        path = tmp_path / f"model{len(runs)}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        loaded.fit(x, y, batch_size=3, shuffle=False, verbose=0)
        runs.append((full_state(loaded, loaded.optimizer), loaded.history.history, loaded.optimizer))
    (reference, ref_history, _), (subject, history, opt) = runs
    assert opt.micro_batch_size == 4
    assert_states_close(reference, subject)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


def test_callbacks_read_auto_before_the_size_is_chosen():
    x, y = make_data(2 * B)
    model, opt = make_mlp(), accumulate(keras.optimizers.Adam(1e-2), micro_batch_size="auto")
    seen = []
    callback = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append(opt.micro_batch_size),
        on_train_batch_end=lambda batch, logs: seen.append(opt.micro_batch_size),
    )
    with out_of_memory_above(4):
        fit(model, opt, x, y, B, fit_kwargs={"callbacks": [callback]})
    assert seen == ["auto", 4, 4]


@pytest.mark.skipif(BACKEND == "torch", reason="Keras's PyTorch trainer takes steps_per_execution=1 only")
def test_steps_per_execution_with_a_ragged_last_batch_equals_plain_fit():
    x, y = make_data(3 * B + 5)
    runs = []
    for wrap in (lambda o: o, lambda o: accumulate(o, micro_batch_size="auto")):
        model, opt = make_mlp(), wrap(keras.optimizers.Adam(1e-2))
        fit(model, opt, x, y, B, steps_per_execution=2)
        runs.append((full_state(model, opt), model.history.history, opt))
    (reference, ref_history, _), (subject, history, opt) = runs
    assert opt.micro_batch_size == B and as_int(opt.iterations) == 4
    assert_states_close(reference, subject)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-6)


def test_accumulating_around_a_third_party_trainer_equals_its_plain_run():
    x, y = make_data(3 * B + 5)
    reference, ref_history = third_party_trainer.train(x, y, B, optimizer=keras.optimizers.Adam(1e-2))
    with accumulating(micro_batch_size="auto"), out_of_memory_above(3):
        model, history = third_party_trainer.train(x, y, B, optimizer=keras.optimizers.Adam(1e-2))
    assert core_of(model.optimizer).micro_batch_size == 2
    assert_states_close(full_state(reference, reference.optimizer), full_state(model, model.optimizer))
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-6)
