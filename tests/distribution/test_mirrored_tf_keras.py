"""tf_keras under MirroredStrategy with two replicas (two logical CPUs).

Plain training under MirroredStrategy matches single-device training to
float32 rounding, so the single-device large batch is the reference.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradaccum import accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    fit,
    full_state,
    make_data,
    make_mlp,
)
from tests.helpers.distribute import mirrored
from tests.helpers.growing import (
    GROW_LEGACY,
    GROW_N,
    GROW_PATTERNS,
    grow_grads,
    grow_reference,
    grow_state,
    grow_variables,
)

N, B, CYCLES = 3, 8, 3
LSO = tf_keras.mixed_precision.LossScaleOptimizer
MAKERS = {
    "new": lambda: tf_keras.optimizers.Adam(1e-2),
    "legacy": lambda: tf_keras.optimizers.legacy.Adam(1e-2),
    "lso_new": lambda: LSO(tf_keras.optimizers.Adam(1e-2)),
    "lso_legacy": lambda: LSO(tf_keras.optimizers.legacy.Adam(1e-2)),
    # Both families all-reduce before clipping: they clip the summed gradient.
    "new_global_clipnorm": lambda: tf_keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
    "new_clipnorm": lambda: tf_keras.optimizers.SGD(0.1, clipnorm=0.05),
    "legacy_global_clipnorm": lambda: tf_keras.optimizers.legacy.Adam(
        1e-2, global_clipnorm=0.05
    ),
    "legacy_clipvalue": lambda: tf_keras.optimizers.legacy.SGD(0.1, clipvalue=0.01),
}


def _strategy():
    # One strategy per process (see `tests.helpers.distribute.mirrored`).
    strategy = mirrored()
    assert strategy.num_replicas_in_sync == 2
    return strategy


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fit_under_mirrored_strategy_matches_large_batch(name):
    make = MAKERS[name]
    x, y = make_data(B * N * CYCLES)
    ref_model, ref_opt = make_mlp(), make()
    fit(ref_model, ref_opt, x, y, B * N)
    with _strategy().scope():
        model, opt = make_mlp(), accumulate(make(), N)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    acc = full_state(model, opt)
    assert acc["iterations"] == CYCLES
    assert_states_close(full_state(ref_model, ref_opt), acc)


@pytest.mark.parametrize("kind", ["lso_new", "lso_legacy"])
def test_non_finite_micro_batch_dropped_on_every_replica(kind):
    strategy = _strategy()
    with strategy.scope():
        model, opt = make_mlp(), accumulate(MAKERS[kind](), N)
    variables = model.trainable_variables

    def replica_step(x, y, poison):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(y - model(x, training=True)), -1)
            # Both replicas see the whole micro-batch: average over both.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=2 * B)
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
        grads = [tf.where(poison, g * np.inf, g) for g in grads]
        opt.apply_gradients(zip(grads, variables))

    @tf.function
    def step(x, y, poison):
        strategy.run(replica_step, args=(x, y, poison))

    x, y = make_data(B * (N + 2))
    batches = [(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)]
    for xb, yb in batches[:N + 1]:  # a full cycle and one micro-step
        step(tf.constant(xb), tf.constant(yb), tf.constant(False))
    before = full_state(model, opt)
    xb, yb = batches[N + 1]
    step(tf.constant(xb), tf.constant(yb), tf.constant(True))
    assert_states_equal(before, full_state(model, opt))
    assert int(opt.inner_optimizer.micro_step) == 1
    assert float(opt.loss_scale) == 2.0**14


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", sorted(GROW_LEGACY))
@pytest.mark.parametrize("mode", MODES)
def test_growing_under_mirrored_strategy(mode, kind, traced):
    """`LSO(accumulate(legacy_opt))` unbuilt under two replicas, with a
    variable first met on an in-between micro-step (see the single-device
    test in `test_mixed_precision_tf_keras`): each replica gets half of each
    micro-gradient, so their all-reduced sum is the single-device one and
    the states agree bit for bit. Traced, one `tf.function` per gradient
    pattern (each adds variables on its first trace only)."""
    strategy = _strategy()
    with strategy.scope():
        variables = grow_variables()
        opt = LSO(accumulate(GROW_LEGACY[kind](), GROW_N, mode=mode))

    def step(*given, at):
        def replica(*given):
            grads = [None] * len(variables)
            for i, g in zip(at, given):
                grads[i] = g / 2
            opt.apply_gradients(zip(grads, variables))

        strategy.run(replica, args=given)

    steps = {}
    for k, pattern in enumerate(GROW_PATTERNS):
        grads = grow_grads(k)
        at = tuple(i for i, g in enumerate(grads) if g is not None)
        given = [grads[i] for i in at]
        if not traced:
            step(*given, at=at)
            continue
        if pattern not in steps:
            steps[pattern] = tf.function(lambda *given, at=at: step(*given, at=at))
        steps[pattern](*given)
    assert [v.name for v in opt.inner_optimizer.accumulation_state.variables] == ["a:0", "b:0"]
    acc = grow_state(variables, opt)
    assert acc["iterations"] == len(GROW_PATTERNS) // GROW_N
    assert_states_equal(grow_reference(GROW_LEGACY[kind]), acc)
