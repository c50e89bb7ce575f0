"""Checkpoints and `.keras` files on TensorFlow, mid-cycle and across switches.

`tf.train.Checkpoint`, `BackupAndRestore`, `ModelCheckpoint`, exports, and
files loaded into an optimizer not built yet in every wrapping with a
loss-scale optimizer. Keras files and configs as every backend has them:
`tests/saving/test_saving.py`.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import (
    MODES,
    assert_states_close,
    assert_states_equal,
    fit,
    full_state,
    gradients,
    make_data,
    make_mlp,
)

N, B = 3, 4
STEPS = 11  # micro-steps in the whole run: three full cycles and a partial one
X, Y = make_data(B * STEPS)


def _adam():
    return keras.optimizers.Adam(1e-2)


def _step(model, opt, k):
    grads = gradients(model, X[k * B : (k + 1) * B], Y[k * B : (k + 1) * B])
    opt.apply_gradients(zip(grads, model.trainable_variables))


def _fresh(n=N, reduction="mean", build=True, mode="masked"):
    model = make_mlp()
    opt = accumulate(_adam(), n, reduction=reduction, mode=mode)
    if build:
        opt.build(model.trainable_variables)
    return model, opt


def _uninterrupted():
    model, opt = _fresh()
    for k in range(STEPS):
        _step(model, opt, k)
    return full_state(model, opt)


@pytest.fixture(scope="module")
def uninterrupted():
    return _uninterrupted()


# ----------------------------------------------------------------------
# tf.train.Checkpoint


@pytest.mark.parametrize("stop", [3, 4, 5])  # micro_step 0, 1, 2 at the save
@pytest.mark.parametrize("build_before_restore", [True, False])
def test_checkpoint_mid_cycle_resumes_bit_identical(
    tmp_path, uninterrupted, stop, build_before_restore
):
    model, opt = _fresh()
    for k in range(stop):
        _step(model, opt, k)
    assert int(opt.micro_step) == stop % N
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))

    model2, opt2 = _fresh(build=build_before_restore)
    status = tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    if not build_before_restore:
        opt2.build(model2.trainable_variables)  # deferred values land here
    status.assert_consumed()
    assert int(opt2.micro_step) == stop % N
    for k in range(stop, STEPS):
        _step(model2, opt2, k)
    assert_states_equal(uninterrupted, full_state(model2, opt2))


def test_checkpoint_with_another_n_or_reduction_is_refused(tmp_path):
    model, opt = _fresh()
    _step(model, opt, 0)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    for n, reduction, match in [(4, "mean", "n=3.*n=4"), (N, "sum", "reduction='mean'")]:
        model2, opt2 = _fresh(n=n, reduction=reduction)
        with pytest.raises(ValueError, match=match):
            tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)


def test_checkpoint_for_other_variable_shapes_is_refused(tmp_path):
    model, opt = _fresh()
    _step(model, opt, 0)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    other = make_mlp(widths=(7,))
    opt2 = accumulate(_adam(), N)
    opt2.build(other.trainable_variables)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="shape"):
        tf.train.Checkpoint(model=other, optimizer=opt2).restore(path)


def test_plain_checkpoint_restores_into_accumulating_optimizer(tmp_path):
    """Slots land in the right variables; accumulators start empty."""
    model, plain = make_mlp(), _adam()
    fit(model, plain, X[: B * N * 2], Y[: B * N * 2], B * N)
    path = tf.train.Checkpoint(model=model, optimizer=plain).save(str(tmp_path / "ckpt"))

    model2, opt2 = _fresh()
    # Everything the checkpoint holds is used; only the accumulation state,
    # which it does not hold, stays as built.
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    assert_states_equal(full_state(model, plain), full_state(model2, opt2))
    assert int(opt2.micro_step) == 0
    state = opt2.accumulation_state
    assert all(not np.any(a.numpy()) for a in state.accumulators)

    # ... and training continues exactly as the large batch does.
    fit(model, plain, X[B * N * 2 : B * N * 3], Y[B * N * 2 : B * N * 3], B * N)
    fit(model2, opt2, X[B * N * 2 : B * N * 3], Y[B * N * 2 : B * N * 3], B)
    assert_states_close(full_state(model, plain), full_state(model2, opt2))


def test_accumulating_checkpoint_restores_into_plain_optimizer(tmp_path):
    model, opt = _fresh()
    for k in range(2 * N):  # two whole cycles
        _step(model, opt, k)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    model2, plain = make_mlp(), _adam()
    plain.build(model2.trainable_variables)
    status = tf.train.Checkpoint(model=model2, optimizer=plain).restore(path)
    status.assert_existing_objects_matched()
    assert_states_equal(full_state(model, opt), full_state(model2, plain))


# ----------------------------------------------------------------------
# A later cycle: the accumulators hold the last cycle's sums until the
# cycle's first micro-step writes over them. What is saved, restored or seen
# mid-cycle must be the same cycle.

N_SCALED = 4
STOPS_SCALED = [5, 6, 7]  # micro_step 1, 2, 3 of the second cycle


def _run(model, opt, steps, traced):
    apply = opt.apply_gradients
    if traced:
        apply = tf.function(lambda grads: opt.apply_gradients(zip(grads, model.trainable_variables)))
    for k in steps:
        grads = gradients(model, X[k * B : (k + 1) * B], Y[k * B : (k + 1) * B])
        if traced:
            apply(grads)
        else:
            apply(zip(grads, model.trainable_variables))


@pytest.fixture(scope="module")
def uninterrupted_scaled():
    out = {}
    for mode in MODES:
        for traced in (False, True):
            model, opt = _fresh(n=N_SCALED, mode=mode)
            _run(model, opt, range(STEPS), traced)
            out[mode, traced] = full_state(model, opt)
    return out


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["checkpoint", "keras_file", "weights_into_trained", "view"])
def test_later_cycle_resumes_bit_identical(tmp_path, uninterrupted_scaled, how, mode, traced):
    """A checkpoint, a Keras file (also loaded into an optimizer that has
    applied a cycle of its own) and a look at `accumulation_state` mid-cycle
    all continue the same cycle."""
    stop = STOPS_SCALED[["checkpoint", "keras_file", "weights_into_trained", "view"].index(how) % 3]
    model, opt = _fresh(n=N_SCALED, mode=mode)
    model.compile(optimizer=opt, loss="mse")
    _run(model, opt, range(stop), traced)
    if how == "checkpoint":
        path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
        model, opt = _fresh(n=N_SCALED, mode=mode)
        tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_consumed()
    elif how == "keras_file":
        model.save(str(tmp_path / "m.keras"))
        model = keras.models.load_model(str(tmp_path / "m.keras"))
        opt = model.optimizer
    elif how == "weights_into_trained":
        model.save_weights(str(tmp_path / "m.weights.h5"))
        model, opt = _fresh(n=N_SCALED, mode=mode)
        model.compile(optimizer=opt, loss="mse")
        _run(model, opt, range(STEPS - N_SCALED, STEPS), traced)  # one whole cycle
        model.load_weights(str(tmp_path / "m.weights.h5"))
    else:
        done = range(N_SCALED, stop)  # this cycle's micro-steps so far
        expected = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
        for k in done:
            # The gradients at the weights of the first update, as applied.
            grads = gradients(model, X[k * B : (k + 1) * B], Y[k * B : (k + 1) * B])
            expected = [e + g.numpy() for e, g in zip(expected, grads)]
        state = opt.accumulation_state
        assert int(state.micro_step) == len(done)
        for acc, e in zip(state.accumulators, expected):
            np.testing.assert_allclose(acc.numpy(), e, rtol=1e-6, atol=1e-7)
    _run(model, opt, range(stop, STEPS), traced)
    assert_states_equal(uninterrupted_scaled[mode, traced], full_state(model, opt))


# ----------------------------------------------------------------------
# .keras files and configs


def test_keras_file_mid_cycle_round_trip(tmp_path, uninterrupted):
    stop = 4
    model, opt = _fresh()
    model.compile(optimizer=opt, loss="mse")
    for k in range(stop):
        _step(model, opt, k)
    path = str(tmp_path / "m.keras")
    model.save(path)

    loaded = keras.models.load_model(path)  # safe_mode=True, no custom_objects
    opt2 = loaded.optimizer
    assert issubclass(type(opt2), AccumulatingOptimizer)
    assert (opt2.n, opt2.reduction) == (N, "mean")
    assert opt2.__wrapped__.get_config() == opt.__wrapped__.get_config() | {
        "name": opt2.__wrapped__.name
    }
    assert int(opt2.micro_step) == stop % N
    assert_states_equal(full_state(model, opt), full_state(loaded, opt2))
    for k in range(stop, STEPS):
        _step(loaded, opt2, k)
    assert_states_equal(uninterrupted, full_state(loaded, opt2))


# ----------------------------------------------------------------------
# Loading into a compiled model whose optimizer has not stepped yet
#
# `model.load_weights` (keras-tuner's `get_best_models`, resuming from
# `ModelCheckpoint(save_weights_only=True)`) meets an unbuilt optimizer.
# Plain Keras drops the optimizer state there; the accumulating optimizer
# keeps it for its build, so the resumed run equals the uninterrupted one.

LOAD_N, LOAD_STOP, LOAD_STEPS = 4, 6, 10  # saved mid-cycle: micro_step 2
LOAD_X, LOAD_Y = make_data(B * LOAD_STEPS)


def _compiled(mode, wrap):
    model = make_mlp()
    if wrap == "core":
        opt = accumulate(_adam(), LOAD_N, mode=mode)
    elif wrap == "front":  # accumulate(LossScaleOptimizer(opt))
        opt = accumulate(keras.optimizers.LossScaleOptimizer(_adam()), LOAD_N, mode=mode)
    else:  # LossScaleOptimizer(accumulate(opt)), as compile under mixed_float16 builds
        opt = keras.optimizers.LossScaleOptimizer(accumulate(_adam(), LOAD_N, mode=mode))
    model.compile(optimizer=opt, loss="mse")
    return model


def _fit_range(model, start, stop):
    x, y = LOAD_X[start * B : stop * B], LOAD_Y[start * B : stop * B]
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)


def _save(model, directory, how):
    if how == "checkpoint":
        return tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(directory / "c"))
    path = str(directory / ("m.keras" if how == "keras" else "m.weights.h5"))
    model.save(path) if how == "keras" else model.save_weights(path)
    return path


def _load(model, path, how):
    if how == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    else:
        model.load_weights(path)  # a `.keras` file too: its weights


_UNINTERRUPTED: dict[tuple[str, str], dict] = {}


def _uninterrupted_loaded(mode, wrap):
    """The run without a break, once per mode and wrapping."""
    if (mode, wrap) not in _UNINTERRUPTED:
        model = _compiled(mode, wrap)
        _fit_range(model, 0, LOAD_STEPS)
        _UNINTERRUPTED[mode, wrap] = full_state(model, model.optimizer)
    return _UNINTERRUPTED[mode, wrap]


@pytest.mark.parametrize(
    "mode, wrap, how",
    # A weights file into the bare core, in both modes, is
    # tests/saving/test_saving.py::test_weights_file_loaded_before_the_build_resumes_bit_for_bit.
    [("masked", wrap, how) for wrap in ("core", "front", "outer")
     for how in ("weights_h5", "keras", "checkpoint") if (wrap, how) != ("core", "weights_h5")]
    # Skip mode: each wrapping and each way of saving once.
    + [("skip", "front", "keras"), ("skip", "outer", "checkpoint"), ("skip", "core", "checkpoint")],
)
def test_loaded_before_build_resumes_bit_identical(tmp_path, mode, wrap, how):
    model = _compiled(mode, wrap)
    _fit_range(model, 0, LOAD_STOP)
    path = _save(model, tmp_path, how)
    resumed = _compiled(mode, wrap)
    assert not resumed.optimizer.built
    _load(resumed, path, how)
    _fit_range(resumed, LOAD_STOP, LOAD_STEPS)
    assert_states_equal(_uninterrupted_loaded(mode, wrap), full_state(resumed, resumed.optimizer))


def test_loaded_before_build_lands_at_build_with_the_partial_cycle(tmp_path):
    model = _compiled("masked", "core")
    _fit_range(model, 0, LOAD_STOP)
    path = _save(model, tmp_path, "weights_h5")
    resumed = _compiled("masked", "core")
    resumed.load_weights(path)
    resumed.optimizer.build(resumed.trainable_variables)
    assert int(resumed.optimizer.micro_step) == LOAD_STOP % LOAD_N
    assert_states_equal(full_state(model, model.optimizer), full_state(resumed, resumed.optimizer))
    saved, loaded = model.optimizer.accumulation_state, resumed.optimizer.accumulation_state
    for a, b in zip(saved.accumulators, loaded.accumulators):
        assert np.array_equal(a.numpy(), b.numpy())
    assert np.array_equal(saved.weight_total.numpy(), loaded.weight_total.numpy())


def test_loaded_before_build_and_saved_again_keeps_the_values(tmp_path):
    """A model loaded and saved again before it trains (keras-tuner saves the
    best models it reloads) writes what it was given, not empty state."""
    model = _compiled("masked", "core")
    _fit_range(model, 0, LOAD_STOP)
    first = _save(model, tmp_path, "weights_h5")
    middle = _compiled("masked", "core")
    middle.load_weights(first)
    (tmp_path / "again").mkdir()
    second = _save(middle, tmp_path / "again", "weights_h5")
    resumed = _compiled("masked", "core")
    resumed.load_weights(second)
    resumed.optimizer.build(resumed.trainable_variables)
    assert_states_equal(full_state(model, model.optimizer), full_state(resumed, resumed.optimizer))


def test_plain_weights_file_loaded_before_build(tmp_path):
    """The plain optimizer's file: its slots and `iterations` land at the
    build, the accumulators start empty, training continues as the plain
    optimizer on the large batch does."""
    big = B * LOAD_N
    x, y = make_data(3 * big)
    plain_model = make_mlp()
    plain_model.compile(optimizer=_adam(), loss="mse")
    plain_model.fit(x[: 2 * big], y[: 2 * big], batch_size=big, shuffle=False, verbose=0)
    path = _save(plain_model, tmp_path, "weights_h5")
    resumed = _compiled("masked", "core")
    resumed.load_weights(path)
    resumed.optimizer.build(resumed.trainable_variables)
    assert_states_equal(full_state(plain_model, plain_model.optimizer), full_state(resumed, resumed.optimizer))
    assert int(resumed.optimizer.micro_step) == 0
    x, y = x[2 * big :], y[2 * big :]
    plain_model.fit(x, y, batch_size=big, shuffle=False, verbose=0)
    resumed.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_states_close(
        full_state(plain_model, plain_model.optimizer), full_state(resumed, resumed.optimizer)
    )


def test_weights_file_with_another_n_is_refused_before_build(tmp_path):
    model = _compiled("masked", "core")
    _fit_range(model, 0, 1)
    path = _save(model, tmp_path, "weights_h5")
    other = make_mlp()
    other.compile(optimizer=accumulate(_adam(), LOAD_N + 1), loss="mse")
    with pytest.raises(ValueError, match=f"n={LOAD_N}.*n={LOAD_N + 1}"):
        other.load_weights(path)


# ----------------------------------------------------------------------
# Callbacks that save and restore


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_batch):
        super().__init__()
        self.at, self.seen = at_batch, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.at:
            raise RuntimeError("interrupted")
        self.seen += 1


def test_backup_and_restore_mid_cycle(tmp_path):
    """10 micro-batches an epoch, n=3: every epoch ends mid-cycle."""
    x, y = make_data(B * 10)
    epochs = 3
    ref_model, ref_opt = _fresh(build=False)
    ref_model.compile(optimizer=ref_opt, loss="mse")
    ref_model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    model, opt = _fresh(build=False)
    model.compile(optimizer=opt, loss="mse")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(14)],
        )
    model2, opt2 = _fresh(build=False)
    model2.compile(optimizer=opt2, loss="mse")
    model2.fit(
        x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert_states_equal(full_state(ref_model, ref_opt), full_state(model2, opt2))


def test_model_checkpoint_mid_cycle(tmp_path):
    x, y = make_data(B * 10)
    ref_model, ref_opt = _fresh(build=False)
    ref_model.compile(optimizer=ref_opt, loss="mse")
    ref_model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)

    path = str(tmp_path / "epoch{epoch}.keras")
    model, opt = _fresh(build=False)
    model.compile(optimizer=opt, loss="mse")
    model.fit(
        x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(path)],
    )
    loaded = keras.models.load_model(str(tmp_path / "epoch1.keras"))
    assert int(loaded.optimizer.micro_step) == 10 % N
    loaded.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_states_equal(full_state(ref_model, ref_opt), full_state(loaded, loaded.optimizer))


# ----------------------------------------------------------------------
# Exports for inference


def test_saved_model_and_export_with_accumulating_optimizer(tmp_path):
    model, opt = _fresh(build=False)
    fit(model, opt, X[:B * 4], Y[:B * 4], B)
    expected = model.predict(X[:5], verbose=0)
    serve = tf.function(
        lambda x: {"y": model(x)}, input_signature=[tf.TensorSpec([None, 5], tf.float32)]
    )
    tf.saved_model.save(model, str(tmp_path / "saved"), signatures=serve)
    restored = tf.saved_model.load(str(tmp_path / "saved"))
    out = restored.signatures["serving_default"](tf.constant(X[:5]))["y"]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)

    model.export(str(tmp_path / "export"))
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(served.serve(tf.constant(X[:5])).numpy(), expected, rtol=1e-6)
    assert os.path.isdir(str(tmp_path / "export"))


def test_restored_accumulator_is_applied_when_its_gradient_is_none(tmp_path):
    """Found by the state machine: after a restore, a variable whose gradient
    is None on the apply step must still get its restored accumulated sum."""

    def run(restore_after=None):
        model, opt = _fresh(n=2)
        grads = gradients(model, X[:B], Y[:B])
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if restore_after is not None:
            path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "c"))
            model, opt = _fresh(n=2)
            tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
        grads = list(gradients(model, X[B : 2 * B], Y[B : 2 * B]))
        grads[0] = None  # no gradient for the first variable on the apply step
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return full_state(model, opt)

    assert_states_equal(run(), run(restore_after=1))


def _schedule_free_momenta_after_restore(tmp_path, wrap, build):
    """Saves a built ScheduleFreeAdamW whose momenta differ from the weights,
    restores it into a fresh unbuilt one, builds that (`"eager"` or inside a
    `tf.function`) and returns `(saved, restored)` momenta by name."""

    def make():
        model = make_mlp()
        opt = keras.optimizers.ScheduleFreeAdamW(1e-2)
        return model, (accumulate(opt, N) if wrap else opt)

    def momenta(opt):
        return {v.name: v for v in opt.variables if v.name.endswith("_momentum")}

    def values(opt):
        return {name: v.numpy() for name, v in momenta(opt).items()}

    model, opt = make()
    opt.build(model.trainable_variables)
    for v in momenta(opt).values():
        v.assign(v + 7.0)
    saved = values(opt)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "c"))
    model, opt = make()
    tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
    if build == "eager":
        opt.build(model.trainable_variables)
    else:
        tf.function(lambda: opt.build(model.trainable_variables))()
    restored = values(opt)
    assert saved and sorted(saved) == sorted(restored)
    return saved, restored


@pytest.mark.parametrize("build", ["eager", "traced"])
def test_schedule_free_restored_unbuilt_matches_the_plain_optimizer(tmp_path, build):
    """Keras's `ScheduleFreeAdamW.build` sets its momenta to the weights after
    creating them: built eagerly after a restore into an unbuilt optimizer,
    that overwrites the restored momenta; built inside a `tf.function`, the
    assignment is lost. The accumulating optimizer must do exactly what the
    plain one does in both cases (the pinned test below shows Keras's part)."""
    _, plain = _schedule_free_momenta_after_restore(tmp_path / "plain", False, build)
    _, wrapped = _schedule_free_momenta_after_restore(tmp_path / "wrapped", True, build)
    assert plain.keys() == wrapped.keys()
    for name in plain:
        np.testing.assert_array_equal(wrapped[name], plain[name], err_msg=name)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Keras's ScheduleFreeAdamW.build assigns the weights to the momenta after "
    "creating them, overwriting the values a checkpoint restored into an unbuilt "
    "optimizer. When Keras fixes it, the property test's `assume` on this case and "
    "the README note can go."))
def test_keras_schedule_free_restored_unbuilt_keeps_its_momenta(tmp_path):
    saved, restored = _schedule_free_momenta_after_restore(tmp_path, False, "eager")
    for name in saved:
        np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)
