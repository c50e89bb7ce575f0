"""The gradient noise scale under MirroredStrategy with two replicas.

Each replica measures its own micro-batches (nothing is communicated per
micro-step); the estimates are in samples, and the micro-batch weight the
state reports is the global micro-batch's.
"""

import keras

from gradaccum import accumulate
from tests.backends.test_noise_scale import ANALYTIC, _measured, _regression, _within
from tests.helpers.distribute import mirrored


def test_two_replicas_measure_the_analytic_noise_scale_of_linear_regression():
    """Global micro-batches of 16 (8 per replica), 8 per cycle, 200 cycles
    averaged (decay 0.99): within 10% of the analytic values."""
    B, n, cycles = 16, 8, 200
    with mirrored().scope():
        model, x, y = _regression(B * n * cycles)
        opt = accumulate(keras.optimizers.SGD(0.0), n, noise_scale=True, noise_decay=0.99)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    state = opt.accumulation_state
    assert state.noise_cycles == cycles
    assert abs(state.noise_batch - B) < 1e-3
    _within(_measured(state), ANALYTIC, 0.10)


def test_n_from_the_noise_scale_is_refused_on_several_replicas():
    """Each replica measures its own micro-batches: they would choose apart."""
    import pytest

    from gradaccum.schedules import from_noise_scale
    from tests.helpers import make_data, make_mlp

    x, y = make_data(32)
    with mirrored().scope():
        model = make_mlp()
        model.compile(optimizer=accumulate(keras.optimizers.SGD(0.1), from_noise_scale(2, 8)), loss="mse")
    with pytest.raises(ValueError, match="one replica only"):
        model.fit(x, y, batch_size=8, verbose=0)
