"""A variable with no gradient in a whole cycle is left alone, as in the large batch.

The large batch never updates a variable absent from its gradient list:
neither the variable nor its optimizer state (momentum, Adam's moments,
weight decay) changes in that update, while `iterations` and the moving
averages of EMA (which Keras keeps for every variable the optimizer was
built for) move as usual. A variable with gradients in some micro-steps of a
cycle only takes part with its partial sum. This covers a layer frozen (and
unfrozen) between `fit` calls and a branch not taken in a custom loop.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import BACKEND, assert_states_close, full_state, gradients, make_data, make_mlp

N, B = 3, 4
# On TensorFlow the two modes leave variables alone each its own way (masked
# writes around every micro-step's update, or inside the apply step's
# branch): the `mode` fixture (conftest.py) runs both there.

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "adam_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    # Classes that override part of Keras's update: Nadam its
    # `_backend_update_step` (a product of every step), Muon its weight decay.
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "muon": lambda: keras.optimizers.Muon(1e-2, weight_decay=0.1),
}

# Which micro-steps give the first layer's kernel and bias no gradient, over
# four cycles of N: none in the whole second cycle (a frozen layer, or a
# branch not taken) and back in the third; none in the last two micro-steps
# of the fourth (frozen mid-cycle: its partial sum takes part).
WITHOUT = {3, 4, 5, 10, 11}


def _micro_grads(model, x, y, k):
    grads = gradients(model, x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
    return [None if (k in WITHOUT and j < 2) else g for j, g in enumerate(grads)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_custom_loop_leaves_variables_without_gradients_alone(name, mode):
    x, y = make_data(B * N * 4)
    reference, subject = make_mlp(), make_mlp()
    ref_opt = OPTIMIZERS[name]()
    ref_opt.build(reference.trainable_variables)
    opt = accumulate(OPTIMIZERS[name](), N, mode=mode)
    opt.build(subject.trainable_variables)
    for cycle in range(4):
        # The reference: each cycle's mean over the micro-steps, for the
        # variables with a gradient in the cycle (at the reference's weights,
        # which equal the subject's at the start of the cycle).
        sums, variables = {}, list(reference.trainable_variables)
        for k in range(cycle * N, (cycle + 1) * N):
            for j, g in enumerate(_micro_grads(reference, x, y, k)):
                if g is not None:
                    sums[j] = sums.get(j, 0) + np.asarray(keras.ops.convert_to_numpy(g), np.float64)
        present = sorted(sums)
        ref_opt.apply(
            [keras.ops.convert_to_tensor((sums[j] / N).astype("float32")) for j in present],
            [variables[j] for j in present],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(cycle * N, (cycle + 1) * N):
                opt.apply(_micro_grads(subject, x, y, k), subject.trainable_variables)
        assert not [str(w.message) for w in caught if "gradaccum" in str(w.message)]
    assert_states_close(full_state(reference, ref_opt), full_state(subject, opt))


def _fit(model, optimizer, x, y, batch_size):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)


@pytest.mark.skipif(BACKEND == "jax", reason="Keras's JAX trainer refuses an optimizer built for other variables")
# Not with EMA: at the end of `fit` Keras overwrites the model's trainable
# variables with their averages and refuses a list shorter than the one the
# optimizer was built for, the plain optimizer included.
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_fit_with_a_layer_frozen_and_unfrozen_between_cycles(name):
    """Freezing recompiles with the same optimizer; the frozen kernel and its
    state stay as the large batch leaves them, then train again."""
    x, y = make_data(B * N * 2)
    states = []
    for make, batch in ((lambda: OPTIMIZERS[name](), B * N), (lambda: accumulate(OPTIMIZERS[name](), N), B)):
        model, optimizer = make_mlp(), make()
        _fit(model, optimizer, x, y, batch)
        model.layers[0].trainable = False
        frozen = np.array(keras.ops.convert_to_numpy(model.layers[0].kernel))
        _fit(model, optimizer, x, y, batch)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.layers[0].kernel), frozen)
        model.layers[0].trainable = True
        _fit(model, optimizer, x, y, batch)
        states.append(full_state(model, optimizer))
    assert_states_close(*states)


def test_ema_overwrite_reaches_a_variable_without_gradients(mode):
    """With `ema_overwrite_frequency`, Keras overwrites every variable the
    optimizer was built for with its moving average after each update, the
    one absent from the gradient list too; such a variable then moves by the
    average's rounding, which must match bit for bit."""
    rng = np.random.default_rng(0)
    start = [rng.normal(size=s).astype("float32") for s in [(3, 2), (2,), (6, 2)]]

    def run(accumulating):
        variables = [keras.Variable(v) for v in start]
        opt = keras.optimizers.SGD(0.01, use_ema=True, ema_momentum=0.625, ema_overwrite_frequency=1)
        if accumulating:
            opt = accumulate(opt, 2, mode=mode)
        opt.build(variables)
        grads = [[keras.ops.full(v.shape, 0.1 * (s + 1), "float32") for v in variables] for s in range(4)]
        for s in (2, 3):
            grads[s][2] = None  # the table has no gradient in the second cycle
        if accumulating:
            for g in grads:
                opt.apply(g, variables)
        else:
            opt.apply([(a + b) / 2 for a, b in zip(grads[0], grads[1])], variables)
            opt.apply([(a + b) / 2 for a, b in zip(grads[2][:2], grads[3][:2])], variables[:2])
        return [keras.ops.convert_to_numpy(v) for v in variables]

    for expected, actual in zip(run(False), run(True)):
        np.testing.assert_array_equal(actual, expected)
