"""`model.fit` on the active backend equals the plain optimizer on the large
batch: weights, every optimizer variable and `iterations`, for every Keras 3
optimizer, both modes, and what the optimizer does once per update."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import AccumulatingOptimizer, accumulate, accumulating
from gradaccum.callbacks import FlushPartialCycle
from tests.backends.helpers import BACKEND, JIT
from tests.support import MODES, assert_states_close, fit_pair, full_state, make_data, make_mlp
from tests.test_optimizers import OPTIMIZERS


@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("mode", MODES)
def test_fit_matches_large_batch(mode, jit):
    ref, acc, _, opt = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=4, micro_batch=4, cycles=3, mode=mode, jit_compile=jit
    )
    assert isinstance(opt, AccumulatingOptimizer)
    assert acc["iterations"] == 3
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_matches_large_batch(name, mode):
    ref, acc, _, opt = fit_pair(OPTIMIZERS[name], n=3, micro_batch=4, cycles=3, mode=mode)
    assert acc["iterations"] == 3
    assert_states_close(ref, acc)


def _decay():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)


# What the wrapped optimizer does once per update: each must happen once per
# cycle, as on the large batch, not once per micro-batch.
ONCE_PER_UPDATE = {
    "lr_schedule": lambda: keras.optimizers.Adam(_decay()),
    "ema": lambda: keras.optimizers.SGD(1e-1, use_ema=True, ema_momentum=0.5),
    "ema_overwrite": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    "clipnorm": lambda: keras.optimizers.SGD(1e-1, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(1e-1, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(1e-1, clipvalue=0.01),
    "weight_decay": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.3),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ONCE_PER_UPDATE))
def test_once_per_update(name, mode):
    ref, acc, _, _ = fit_pair(ONCE_PER_UPDATE[name], n=4, micro_batch=4, cycles=3, mode=mode)
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_constraints_apply_once_per_update(mode):
    def model():
        return make_mlp(kernel_constraint=keras.constraints.MaxNorm(0.3))

    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.SGD(0.5), n=4, micro_batch=4, cycles=3, mode=mode, make_model=model
    )
    assert_states_close(ref, acc)


@pytest.mark.parametrize("mode", MODES)
def test_keras_option_differs_where_gradaccum_does_not(mode):
    """The reference can fail: Keras's own option counts micro-steps in a
    learning-rate schedule, and is then measurably off the large batch."""
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(_decay()), n=4, micro_batch=4, cycles=3, mode=mode
    )
    assert_states_close(ref, acc)
    keras_own = fit_pair(
        lambda: keras.optimizers.Adam(_decay()), n=4, micro_batch=4, cycles=3,
        wrap=lambda opt, n: keras.optimizers.Adam(_decay(), gradient_accumulation_steps=n),
    )[1]
    gap = max(float(np.max(np.abs(ref[k] - keras_own[k]))) for k in ref if k.startswith("model/"))
    assert gap > 1e-3


def _sample_weighted_data():
    x, y = make_data(48)
    # Sample weights that differ between micro-batches, with a loss that
    # divides each micro-batch by its own sum of weights.
    w = np.random.default_rng(3).uniform(0.1, 3.0, size=48).astype("float32")
    return x, y, w


@pytest.mark.parametrize("mode", MODES)
def test_loss_counts_weigh_micro_batches_as_the_large_batch(mode):
    """`weigh_by="count"` (the default): each micro-batch weighs what its loss
    was divided by, here its sum of sample weights."""
    x, y, w = _sample_weighted_data()
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    states = {}
    for name, batch, make in (
        ("ref", 16, lambda: keras.optimizers.Adam(1e-2)),
        ("count", 4, lambda: accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode)),
        ("batch", 4, lambda: accumulate(keras.optimizers.Adam(1e-2), 4, mode=mode, weigh_by="batch")),
    ):
        model = make_mlp()
        opt = make()
        model.compile(optimizer=opt, loss=loss)
        model.fit(x, y, sample_weight=w, batch_size=batch, shuffle=False, verbose=0)
        states[name] = full_state(model, opt)
    assert_states_close(states["ref"], states["count"])
    # Weighing every micro-batch alike is off: the test can fail.
    gap = max(float(np.max(np.abs(states["ref"][k] - states["batch"][k]))) for k in states["ref"])
    assert gap > 1e-4


def test_n_set_between_fits_takes_effect():
    x, y = make_data(32)
    ref_model, acc_model = make_mlp(), make_mlp()
    ref = keras.optimizers.Adam(1e-2)
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    ref_model.compile(optimizer=ref, loss="mse")
    acc_model.compile(optimizer=opt, loss="mse")
    ref_model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    acc_model.fit(x[:16], y[:16], batch_size=4, shuffle=False, verbose=0)
    opt.n = 4
    ref_model.fit(x[16:], y[16:], batch_size=16, shuffle=False, verbose=0)
    acc_model.fit(x[16:], y[16:], batch_size=4, shuffle=False, verbose=0)
    assert opt.n == 4 and int(keras.ops.convert_to_numpy(opt.iterations)) == 3
    assert_states_close(full_state(ref_model, ref), full_state(acc_model, opt))


def test_flush_partial_cycle_callback_applies_the_rest():
    """Six micro-batches with n=4: one update of four, then the flush applies
    the mean of the last two, as a large batch of those two would."""
    x, y = make_data(24)
    ref_model, acc_model = make_mlp(), make_mlp()
    ref = keras.optimizers.Adam(1e-2)
    opt = accumulate(keras.optimizers.Adam(1e-2), 4)
    ref_model.compile(optimizer=ref, loss="mse")
    ref_model.train_on_batch(x[:16], y[:16])
    ref_model.train_on_batch(x[16:], y[16:])
    acc_model.compile(optimizer=opt, loss="mse")
    acc_model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[FlushPartialCycle("train_end")])
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 2
    assert int(keras.ops.convert_to_numpy(opt.micro_step)) == 0
    assert_states_close(full_state(ref_model, ref), full_state(acc_model, opt))


def test_accumulating_wraps_what_compile_is_given():
    x, y = make_data(48)
    ref_model, model = make_mlp(), make_mlp()
    ref = keras.optimizers.Adam(1e-2)
    ref_model.compile(optimizer=ref, loss="mse")
    ref_model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    with accumulating(n=4):
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert isinstance(model.optimizer, AccumulatingOptimizer)
    assert_states_close(full_state(ref_model, ref), full_state(model, model.optimizer))


@pytest.mark.skipif(BACKEND != "jax", reason="traces are JAX's: PyTorch runs eagerly")
def test_jax_fit_traces_once_for_any_n(monkeypatch):
    """The proxy's Python code runs once per trace: setting `n` between fits
    changes a variable the trace reads, not the trace."""
    from gradaccum import AccumulatingOptimizer

    calls = []
    apply = AccumulatingOptimizer.apply

    def counting(self, *args, **kwargs):
        calls.append(1)
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(AccumulatingOptimizer, "apply", counting)
    x, y = make_data(64)
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    traced = len(calls)
    assert 1 <= traced <= 2
    for n in (4, 8, 3):
        opt.n = n
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert len(calls) == traced
    # 16 micro-batches per fit: 8 updates with n=2, then 4, 2 and 5 (the
    # last cycle of n=3 holds one micro-batch).
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 8 + 4 + 2 + 5
