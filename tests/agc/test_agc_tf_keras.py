"""tf_keras: adaptive gradient clipping of the accumulated gradient.

The reference trains the plain optimizer on batches of `B * n` and clips
each large-batch gradient with the NumPy reference (`tests.helpers.agc`);
the subject is `accumulate(optimizer, n, agc=...)` on micro-batches of `B`.
"""

import pytest
import tf_keras

from gradaccum import accumulate
from tests.helpers import MODES, assert_states_close, full_state, make_data, make_mlp
from tests.helpers.agc import train_clipped
from tests.helpers.distribute import mirrored

N, B, CYCLES = 4, 4, 3
FACTOR, EPS = 0.3, 1e-3
MAKERS = {
    "new_adam": lambda: tf_keras.optimizers.Adam(1e-2),
    "new_sgd_clipnorm": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.5, clipnorm=0.01),
    "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(1e-2),
    "legacy_sgd_momentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
}


def _is_out(v) -> bool:
    return v.name.startswith("out/")


def reference(make, x, y, batch, exclude=lambda v: False):
    model, opt = make_mlp(), make()
    clipped, left = train_clipped(
        model, opt, tf_keras.losses.MeanSquaredError(), x, y, batch, FACTOR, EPS, exclude
    )
    assert clipped > 0 and left > 0, (clipped, left)
    return full_state(model, opt)


def _fit(model, opt, x, y, batch=B):
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return full_state(model, opt)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fit_equals_large_batch_clipped(name, mode):
    x, y = make_data(B * N * CYCLES)
    ref = reference(MAKERS[name], x, y, B * N)
    opt = accumulate(MAKERS[name](), N, mode=mode, agc=FACTOR, agc_eps=EPS)
    got = _fit(make_mlp(), opt, x, y)
    assert got["iterations"] == CYCLES
    assert_states_close(ref, got)


def test_n1_and_excluded_names():
    x, y = make_data(B * N * CYCLES)
    ref = reference(MAKERS["new_adam"], x, y, B, exclude=_is_out)
    opt = accumulate(MAKERS["new_adam"](), 1, agc=FACTOR, agc_exclude=["out/kernel:0", "out/bias"])
    assert_states_close(ref, _fit(make_mlp(), opt, x, y))


@pytest.mark.parametrize("name", ["new_adam", "legacy_adam"])
def test_mirrored_strategy_clips_the_replica_sum(name):
    x, y = make_data(B * N * CYCLES)
    ref = reference(MAKERS[name], x, y, B * N)
    with mirrored().scope():
        model, opt = make_mlp(), accumulate(MAKERS[name](), N, agc=FACTOR)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_states_close(ref, full_state(model, opt))
