"""The gradient noise scale under MirroredStrategy with two replicas.

Each replica measures its own micro-batches (nothing is communicated per
micro-step); the estimates are in samples, and the micro-batch weight the
state reports is the global micro-batch's.
"""

import keras
import pytest

from gradaccum import accumulate
from tests.helpers import MODES
from tests.helpers.distribute import mirrored
from tests.noise_scale.test_noise_scale import (
    ANALYTIC,
    _measured,
    _regression,
    _within,
    assert_same_estimates,
    embedding_noise,
)


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


def test_two_replicas_measure_kept_slices_as_their_rows_would_be():
    """Each replica measures the slices it keeps itself (the first replica
    alone hands the summed fixed ones to the optimizer)."""
    assert_same_estimates(embedding_noise("auto", scope=mirrored().scope()),
                          embedding_noise("rows", scope=mirrored().scope()))


@pytest.mark.parametrize("update_mode", MODES)
def test_two_replicas_choose_n_together_and_each_cycle_equals_its_large_batch(update_mode):
    """`from_noise_scale` on two replicas: both choose the same `n` from
    their estimates summed (else one would apply while the other adds, and
    the update's all-reduce would not meet); every cycle equals one device
    training the plain optimizer on that cycle's micro-batches joined."""
    from gradaccum.schedules import from_noise_scale
    from tests.helpers import assert_states_close, full_state

    B = 8  # global micro-batch: 4 per replica
    reference, x, y = _regression(B * 120)
    ref_opt = keras.optimizers.SGD(0.01, momentum=0.9)
    reference.compile(optimizer=ref_opt, loss="mse")
    with mirrored().scope():
        model, _, _ = _regression(B * 120)
        opt = accumulate(keras.optimizers.SGD(0.01, momentum=0.9),
                         from_noise_scale(min_n=2, max_n=16, hysteresis=0.2), noise_decay=0.5, mode=update_mode)
        model.compile(optimizer=opt, loss="mse")
    # `fit` hands each replica its half of a micro-batch (`train_on_batch`
    # would hand both the whole one); a callback reads where each ends.
    positions = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: positions.append(int(opt.micro_step))
    )
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[callback])
    sizes, start, steps = [], 0, 0
    for k, position in enumerate(positions):
        steps += 1
        if position == 0:  # the cycle ended
            sizes.append(steps)
            reference.train_on_batch(x[start : (k + 1) * B], y[start : (k + 1) * B])
            start, steps = (k + 1) * B, 0
    assert sizes[:2] == [2, 2]
    assert len(set(sizes)) > 1 and max(sizes) >= 3, sizes
    assert opt.accumulation_state.n == sizes[-1] or int(opt.micro_step) > 0
    assert abs(opt.accumulation_state.noise_batch - B) < 1e-3
    assert_states_close(full_state(reference, ref_opt), full_state(model, opt))
