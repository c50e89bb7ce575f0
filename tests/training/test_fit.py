"""`model.fit` on the active backend equals the plain optimizer on the large
batch: weights, every optimizer variable and `iterations`, for every Keras 3
optimizer, what the optimizer does once per update, and the ways an
optimizer comes to be wrapped."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import AccumulatingOptimizer, accumulate, accumulating
from gradaccum.callbacks import FlushPartialCycle
from tests.helpers import (
    BACKEND,
    JIT,
    OPTIMIZERS,
    as_int,
    assert_states_close,
    fit,
    fit_pair,
    full_state,
    make_data,
    make_mlp,
    max_difference,
    shipped_optimizers,
)

N, B, CYCLES = 4, 4, 3


@pytest.mark.parametrize("jit", JIT)
def test_fit_matches_large_batch(mode, jit):
    ref, acc, _, opt = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=N, micro_batch=B, cycles=CYCLES, mode=mode, jit_compile=jit
    )
    assert isinstance(opt, AccumulatingOptimizer)
    assert opt.mode == mode
    assert acc["iterations"] == CYCLES
    assert as_int(opt.micro_step) == 0
    assert_states_close(ref, acc)


def test_every_builtin_optimizer_is_covered():
    """A new optimizer in `keras.optimizers` must get an entry in `OPTIMIZERS`."""
    shipped = shipped_optimizers()
    covered = {type(make()).__name__ for make in OPTIMIZERS.values()}
    assert shipped <= covered, sorted(shipped - covered)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_matches_large_batch(name):
    ref, acc, _, opt = fit_pair(OPTIMIZERS[name], n=3, micro_batch=B, cycles=3)
    assert acc["iterations"] == 3
    assert as_int(opt.micro_step) == 0
    assert_states_close(ref, acc)


def _decay():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)


# What the wrapped optimizer does once per update: each must happen once per
# cycle, as on the large batch, not once per micro-batch.
ONCE_PER_UPDATE = {
    "lr_schedule": lambda: keras.optimizers.Adam(_decay()),
    "ema": lambda: keras.optimizers.SGD(1e-1, use_ema=True, ema_momentum=0.5),
    "ema_adam": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    "ema_overwrite": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    "ema_overwrite_sgd": lambda: keras.optimizers.SGD(
        0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    "clipnorm": lambda: keras.optimizers.SGD(1e-1, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(1e-1, global_clipnorm=0.05),
    "global_clipnorm_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(1e-1, clipvalue=0.01),
    "clipvalue_adam": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "weight_decay": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.3),
    "weight_decay_sgd": lambda: keras.optimizers.SGD(0.1, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(ONCE_PER_UPDATE))
def test_once_per_update(name):
    ref, acc, _, _ = fit_pair(ONCE_PER_UPDATE[name], n=N, micro_batch=B, cycles=CYCLES)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)


def test_learning_rate_schedule_sees_applied_updates():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1, 2], [1e-2, 1e-3, 1e-4])
    _, _, _, opt = fit_pair(lambda: keras.optimizers.SGD(schedule), n=3, cycles=CYCLES)
    assert as_int(opt.iterations) == CYCLES
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(opt.learning_rate)), 1e-4)


def test_constraints_apply_once_per_update():
    def model():
        return make_mlp(kernel_constraint=keras.constraints.MaxNorm(0.3))

    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.SGD(0.5), n=N, micro_batch=B, cycles=CYCLES, make_model=model
    )
    assert_states_close(ref, acc)


def test_sum_reduction_matches_sum_reduced_large_batch():
    loss = keras.losses.MeanSquaredError(reduction="sum")
    ref, acc, _, opt = fit_pair(
        lambda: keras.optimizers.SGD(1e-3, momentum=0.5),
        n=3,
        loss=loss,
        wrap=lambda o, n: accumulate(o, n, reduction="sum"),
    )
    assert opt.reduction == "sum"
    assert_states_close(ref, acc)


def test_keras_option_differs_where_gradaccum_does_not():
    """The reference can fail: Keras's own option counts micro-steps in a
    learning-rate schedule, and is then measurably off the large batch."""
    ref, acc, _, _ = fit_pair(lambda: keras.optimizers.Adam(_decay()), n=N, micro_batch=B, cycles=CYCLES)
    assert_states_close(ref, acc)
    keras_own = fit_pair(
        lambda: keras.optimizers.Adam(_decay()), n=N, micro_batch=B, cycles=CYCLES,
        wrap=lambda opt, n: keras.optimizers.Adam(_decay(), gradient_accumulation_steps=n),
    )[1]
    assert max_difference(ref, keras_own, "model/") > 1e-3


@pytest.mark.parametrize("jit", [False, True])
def test_loss_counts_weigh_micro_batches_as_the_large_batch(jit):
    """`weigh_by="count"` (the default): each micro-batch weighs what its loss
    was divided by, here its sum of sample weights; compiled too (on PyTorch
    `torch.compile`, which must not trace the count's recording away)."""
    x, y = make_data(48)
    # Sample weights that differ between micro-batches, with a loss that
    # divides each micro-batch by its own sum of weights.
    w = np.random.default_rng(3).uniform(0.1, 3.0, size=48).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    states = {}
    for name, batch, make in (
        ("ref", 16, lambda: keras.optimizers.Adam(1e-2)),
        ("count", 4, lambda: accumulate(keras.optimizers.Adam(1e-2), 4)),
        ("batch", 4, lambda: accumulate(keras.optimizers.Adam(1e-2), 4, weigh_by="batch")),
    ):
        model = make_mlp()
        opt = make()
        model.compile(optimizer=opt, loss=loss, jit_compile=jit)
        model.fit(x, y, sample_weight=w, batch_size=batch, shuffle=False, verbose=0)
        states[name] = full_state(model, opt)
    assert_states_close(states["ref"], states["count"])
    # Weighing every micro-batch alike is off: the test can fail.
    assert max_difference(states["ref"], states["batch"]) > 1e-4


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
    assert opt.n == 4 and as_int(opt.iterations) == 3
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
    assert as_int(opt.iterations) == 2
    assert as_int(opt.micro_step) == 0
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


# ----------------------------------------------------------------------
# Building and wrapping.


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap", "by_fit"])
def test_build_before_or_after_wrapping(when):
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    x, y = make_data(B * 3 * CYCLES)
    ref_model, ref_opt = make_mlp(), make_opt()
    fit(ref_model, ref_opt, x, y, B * 3)

    model, inner = make_mlp(), make_opt()
    if when == "before_wrap":
        inner.build(model.trainable_variables)
    opt = accumulate(inner, 3)
    assert opt.built == (when == "before_wrap")
    if when == "after_wrap":
        opt.build(model.trainable_variables)
        assert opt.built
    fit(model, opt, x, y, B)
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def test_wrapping_a_trained_optimizer_keeps_its_state():
    """Train plainly for 2 large batches, then continue accumulated."""
    x, y = make_data(B * 3 * 4)
    make_opt = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    ref_model, ref_opt = make_mlp(), make_opt()
    fit(ref_model, ref_opt, x, y, B * 3)

    model, inner = make_mlp(), make_opt()
    fit(model, inner, x[: 2 * B * 3], y[: 2 * B * 3], B * 3)
    opt = accumulate(inner, 3)
    assert as_int(opt.iterations) == 2
    fit(model, opt, x[2 * B * 3 :], y[2 * B * 3 :], B)
    assert_states_close(full_state(ref_model, ref_opt), full_state(model, opt))


def test_decorator_for_a_class_and_a_factory():
    AccAdam = accumulate(n=N)(keras.optimizers.Adam)
    opt = AccAdam(1e-2)
    assert opt.n == N and isinstance(opt, keras.optimizers.Adam)

    @accumulate(n=2, reduction="sum")
    def make():
        return keras.optimizers.SGD(0.1)

    opt2 = make()
    assert (opt2.n, opt2.reduction) == (2, "sum")
    assert make() is not opt2
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=3, wrap=lambda o, n: accumulate(n=n)(lambda: o)()
    )
    assert_states_close(ref, acc)


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
