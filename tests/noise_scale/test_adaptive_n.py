"""`n=gradaccum.schedules.from_noise_scale(...)` on the active backend: `n`
follows the measured noise scale, changes only between cycles, and every
cycle equals the plain optimizer on the large batch of its own size."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from gradaccum.schedules import from_noise_scale
from tests.helpers import assert_states_close, full_state, settings_of
from tests.noise_scale.test_noise_scale import D, _regression

B = 4


def _pair():
    """Two copies of the regression model (B_simple = 21 samples where it
    starts, so n should move from 2 to about 21 / 4 = 5)."""
    return _regression(B * 200)[0], *_regression(B * 200)


def _micro_step(opt) -> int:
    return int(keras.ops.convert_to_numpy(opt.micro_step))


def test_each_cycle_equals_the_large_batch_of_its_own_size():
    """`train_on_batch` per micro-batch (a compiled step on every backend),
    the cycles' sizes read off the micro-step counter; the reference trains
    the plain optimizer on each cycle's micro-batches joined."""
    reference, model, x, y = _pair()
    schedule = from_noise_scale(min_n=2, max_n=16, hysteresis=0.2)
    opt = accumulate(keras.optimizers.SGD(0.01, momentum=0.9), schedule, noise_decay=0.5)
    model.compile(optimizer=opt, loss="mse")
    ref_opt = keras.optimizers.SGD(0.01, momentum=0.9)
    reference.compile(optimizer=ref_opt, loss="mse")
    sizes, start, steps = [], 0, 0
    for k in range(len(x) // B):
        model.train_on_batch(x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
        steps += 1
        if _micro_step(opt) == 0:  # the cycle ended: n micro-batches
            sizes.append(steps)
            reference.train_on_batch(x[start : (k + 1) * B], y[start : (k + 1) * B])
            start, steps = (k + 1) * B, 0
    x, y = x[:start], y[:start]  # a partial last cycle is left out of both
    assert sizes[:2] == [2, 2]  # min_n until a cycle is measured ...
    assert len(set(sizes)) > 1 and max(sizes) >= 4, sizes  # ... then it follows B_simple / B
    assert opt.accumulation_state.n == sizes[-1] or _micro_step(opt) > 0
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))


def test_n_follows_the_noise_scale_rounded_and_clipped():
    """After a measured cycle, `n` is round(B_simple / B) unless that is
    within the hysteresis band of the current `n`, clipped to the bounds."""
    _, model, x, y = _pair()
    opt = accumulate(keras.optimizers.SGD(0.0), from_noise_scale(min_n=2, max_n=100, hysteresis=0.0), noise_decay=0.0)
    model.compile(optimizer=opt, loss="mse")
    for k in range(2):
        model.train_on_batch(x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
    state = opt.accumulation_state
    assert state.n == int(np.clip(round(state.noise_scale / B), 2, 100))

    # Averaged over cycles the estimate nears 21 samples: n = 5, capped at 3.
    capped = accumulate(keras.optimizers.SGD(0.0), from_noise_scale(min_n=2, max_n=3), noise_decay=0.9)
    _, model, x, y = _pair()
    model.compile(optimizer=capped, loss="mse")
    for k in range(60):
        model.train_on_batch(x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
    state = capped.accumulation_state
    assert state.noise_scale / B > 3.5, state.noise_scale
    assert state.n == 3


def test_the_schedule_turns_measuring_on_and_travels_in_configs():
    opt = accumulate(keras.optimizers.Adam(1e-3), from_noise_scale(min_n=2, max_n=32, hysteresis=0.5))
    assert settings_of(opt)["noise_scale"] is True
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert again.n == from_noise_scale(min_n=2, max_n=32, hysteresis=0.5)
    assert settings_of(again)["noise_scale"] is True


def test_a_keras_file_keeps_the_chosen_n(tmp_path):
    _, model, x, y = _pair()
    opt = accumulate(keras.optimizers.SGD(0.0), from_noise_scale(min_n=2, max_n=100, hysteresis=0.0))
    model.compile(optimizer=opt, loss="mse")
    for k in range(41):
        model.train_on_batch(x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
    saved = opt.accumulation_state
    assert saved.n > 2
    path = str(tmp_path / "adaptive.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True).optimizer.accumulation_state
    assert (loaded.n, int(loaded.micro_step)) == (saved.n, int(saved.micro_step))
    assert (loaded.noise_scale, loaded.noise_cycles) == (saved.noise_scale, saved.noise_cycles)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"min_n": 8, "max_n": 4}, ValueError, "min_n=8, max_n=4"),
        ({"min_n": 1, "max_n": 4}, ValueError, "min_n=1"),
        ({"min_n": 0, "max_n": 4}, ValueError, "min_n=0"),
        ({"min_n": 2.0, "max_n": 4}, TypeError, "min_n=2.0 of type float"),
        ({"min_n": 2, "max_n": "8"}, TypeError, "max_n='8'"),
        ({"min_n": 2, "max_n": 4, "hysteresis": -0.1}, ValueError, "hysteresis=-0.1"),
        ({"min_n": 2, "max_n": 4, "hysteresis": "0.1"}, TypeError, "hysteresis='0.1'"),
    ],
)
def test_bad_bounds_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        from_noise_scale(**kwargs)


assert D == 10  # the regression's B_simple (21) is what the tests above expect


def test_a_sum_reduction_is_refused_naming_the_schedule_that_measures():
    """The schedule turns the measurement on: the error says so, since the
    user never passed `noise_scale=True`."""
    with pytest.raises(ValueError, match=r"from_noise_scale.*reduction=\"mean\""):
        accumulate(keras.optimizers.SGD(0.1), n=from_noise_scale(2, 8), reduction="sum")
