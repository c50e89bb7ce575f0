"""How often each mode all-reduces the gradients under MirroredStrategy.

Every Keras 3 optimizer reduces its gradients over replicas with one
`ReplicaContext.all_reduce` call per update. The test counts, at run time,
the calls that reduce a whole gradient (their values add up to the model's
parameters), inside whatever branch they are traced in, so that a call in a
branch not taken is not counted. The reference is the plain optimizer on
the large batch under the same strategy: one gradient all-reduce per update.
"""

import keras
import pytest
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, fit, full_state, make_data, make_mlp
from tests.helpers.distribute import mirrored

N = 3
MICRO_BATCH = 4  # global: 2 samples per replica
CYCLES = 3


@pytest.fixture
def gradient_all_reduces(monkeypatch):
    """A counter of gradient all-reduces per replica, and a function to
    arm it for a model (it counts calls whose values hold one tensor per
    trainable variable)."""
    calls = tf.Variable(0, dtype=tf.int64, trainable=False)
    sizes = {}
    original = tf.distribute.ReplicaContext.all_reduce

    def all_reduce(self, reduce_op, value, options=None):
        out = original(self, reduce_op, value, options)
        flat = tf.nest.flatten(value)
        shapes = sorted(tuple(t.shape) for t in flat)
        if shapes == sizes.get("shapes"):
            with tf.control_dependencies(tf.nest.flatten(out, expand_composites=True)):
                calls.assign_add(1)
        return out

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", all_reduce)

    def arm(model):
        sizes["shapes"] = sorted(tuple(v.shape) for v in model.trainable_variables)
        calls.assign(0)

    def per_replica(strategy):
        return int(calls.numpy()) // strategy.num_replicas_in_sync

    return arm, per_replica


@pytest.mark.parametrize("mode", MODES)
def test_gradient_all_reduces_per_cycle(mode, gradient_all_reduces):
    """Skip mode reduces the gradients once per cycle, as the plain optimizer
    on the large batch does once per update; masked mode, whose update runs
    on every micro-step, once per micro-step."""
    arm, per_replica = gradient_all_reduces
    strategy = mirrored()
    x, y = make_data(MICRO_BATCH * N * CYCLES)

    with strategy.scope():
        reference = make_mlp()
        plain = keras.optimizers.Adam(1e-2)
    arm(reference)
    fit(reference, plain, x, y, MICRO_BATCH * N)
    assert int(plain.iterations.numpy()) == CYCLES
    per_update = per_replica(strategy) / CYCLES
    assert per_update == 1

    with strategy.scope():
        model = make_mlp()
        optimizer = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    arm(model)
    fit(model, optimizer, x, y, MICRO_BATCH)
    assert int(optimizer.iterations.numpy()) == CYCLES
    per_cycle = per_replica(strategy) / CYCLES
    expected = per_update * (N if mode == "masked" else 1)
    assert per_cycle == expected
    # The counted runs trained as the reference did.
    assert_states_close(full_state(reference, plain), full_state(model, optimizer))
