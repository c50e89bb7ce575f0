"""A non-finite micro-batch under a LossScaleOptimizer, in a `tf.function` loop.

Mixed-precision `fit`, both wrapping orders and the eager loop are tested on
every backend in `tests/mixed_precision/test_mixed_precision.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, core_of, fit, full_state, gradients, make_data, make_mlp

N, B, CYCLES = 3, 4, 3
LSO = keras.optimizers.LossScaleOptimizer


def _adam():
    return keras.optimizers.Adam(1e-2)


WRAPS = {
    "accumulate_lso": lambda mode: accumulate(LSO(_adam()), N, mode=mode),
    "lso_accumulate": lambda mode: LSO(accumulate(_adam(), N, mode=mode)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", sorted(WRAPS))
def test_non_finite_micro_batch_is_dropped_in_a_traced_step(order, mode):
    """Micro-batch 4 of 10 has a non-finite gradient.

    Reference: plain float32 training on large batches formed from the 9
    finite micro-batches (the dropped one is simply not there). The scale
    halves once and nothing else changes.
    """
    bad = 4
    x, y = make_data(B * (N * CYCLES + 1))
    micro = [(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)]
    finite = [m for k, m in enumerate(micro) if k != bad]
    xr = np.concatenate([m[0] for m in finite])
    yr = np.concatenate([m[1] for m in finite])
    ref_model, ref_opt = make_mlp(), _adam()
    fit(ref_model, ref_opt, xr, yr, B * N)

    model = make_mlp()
    lso = WRAPS[order](mode)
    scale0 = 2.0**15
    mse = keras.losses.MeanSquaredError()

    def scaled(y_true, y_pred, sample_weight=None):
        return lso.scale_loss(mse(y_true, y_pred))

    @tf.function
    def step(xb, yb, poison):
        grads = gradients(model, xb, yb, loss=scaled)
        grads = [tf.where(poison, g * np.inf, g) for g in grads]
        lso.apply_gradients(zip(grads, model.trainable_variables))

    micro_steps = []
    for k, (xb, yb) in enumerate(micro):
        step(xb, yb, tf.constant(k == bad))
        micro_steps.append(int(core_of(lso).micro_step))
    # The dropped micro-batch does not advance the cycle.
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    np.testing.assert_allclose(float(lso.dynamic_scale), scale0 / 2)
    ref = full_state(ref_model, ref_opt)
    acc = full_state(model, lso.inner_optimizer)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)
