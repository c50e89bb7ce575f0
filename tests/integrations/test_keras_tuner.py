"""keras-tuner: a search whose hypermodel compiles `accumulate(...)`.

Each search runs twice: once with the plain optimizer on the large batch
(the reference) and once accumulating over micro-batches. The oracle's seed
gives both the same trials; the best models must agree to float32 rounding.

keras-tuner reloads a trial's best checkpoint (`model.load_weights`) into a
freshly built and compiled model: in `get_best_models`, and in Hyperband
when a trial continues an earlier one. The accumulating hypermodel leaves
its optimizer unbuilt there, as users write it: the loaded state is kept
until the optimizer is built. The reference's hypermodel builds its plain
optimizer first, since Keras itself would skip the loaded optimizer state
of an unbuilt optimizer (with a warning) and start the continued trial from
fresh moments.
"""

import keras
import keras_tuner
import numpy as np

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import assert_states_close, full_state, make_data

N, B, CYCLES = 2, 4, 3
X, Y = make_data(B * N * CYCLES)
X_VAL, Y_VAL = make_data(16, seed=1)


def _hypermodel(accumulating: bool):
    def build(hp):
        keras.utils.set_random_seed(0)  # every trial starts from the same weights
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(hp.Choice("units", [4, 8]), activation="tanh", name="hidden"),
                keras.layers.Dense(3, name="out"),
            ],
            name="mlp",
        )
        optimizer = keras.optimizers.Adam(hp.Choice("learning_rate", [1e-2, 3e-2]))
        if accumulating:
            optimizer = accumulate(optimizer, N)
        model.compile(optimizer=optimizer, loss="mse")
        if not accumulating:
            # Keras skips a file's optimizer state for an unbuilt optimizer.
            model.optimizer.build(model.trainable_variables)
        return model

    return build


def _search(tuner, accumulating):
    tuner.search(
        X, Y,
        batch_size=B if accumulating else B * N,
        validation_data=(X_VAL, Y_VAL),
        shuffle=False,
        verbose=0,
        **({} if isinstance(tuner, keras_tuner.Hyperband) else {"epochs": 2}),
    )
    return tuner


def _trials(tuner):
    return sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)


def _best_state(tuner, accumulating):
    (model,) = tuner.get_best_models(1)
    optimizer = model.optimizer
    if accumulating:
        assert isinstance(optimizer, AccumulatingOptimizer)
        assert not optimizer.built  # what get_best_models loaded is pending
        optimizer.build(model.trainable_variables)  # ... and assigned now
    return full_state(model, optimizer)


def _compare(make_tuner, tmp_path):
    reference = _search(make_tuner(_hypermodel(False), tmp_path / "reference"), False)
    subject = _search(make_tuner(_hypermodel(True), tmp_path / "subject"), True)
    for tuner in (reference, subject):
        statuses = [t.status for t in _trials(tuner)]
        assert statuses and all(s == "COMPLETED" for s in statuses), statuses
    assert [t.hyperparameters.values for t in _trials(reference)] == [
        t.hyperparameters.values for t in _trials(subject)
    ]
    for r, s in zip(_trials(reference), _trials(subject)):
        np.testing.assert_allclose(s.score, r.score, rtol=1e-5)
    ref_state = _best_state(reference, False)
    sub_state = _best_state(subject, True)
    assert int(ref_state["iterations"]) > 0
    assert_states_close(ref_state, sub_state)
    return reference, subject


def test_random_search_best_models_equal_the_large_batch(tmp_path):
    _compare(
        lambda hypermodel, directory: keras_tuner.RandomSearch(
            hypermodel, objective="val_loss", max_trials=2, seed=1,
            directory=str(directory), project_name="search", overwrite=True,
        ),
        tmp_path,
    )


def test_hyperband_continued_trials_load_checkpoints_and_equal_the_large_batch(tmp_path):
    reference, subject = _compare(
        lambda hypermodel, directory: keras_tuner.Hyperband(
            hypermodel, objective="val_loss", max_epochs=3, factor=3, seed=1,
            hyperband_iterations=1, directory=str(directory), project_name="hyperband",
            overwrite=True,
        ),
        tmp_path,
    )
    continued = [t for t in _trials(subject) if "tuner/trial_id" in t.hyperparameters.values]
    assert continued  # some trial loaded an earlier trial's checkpoint
