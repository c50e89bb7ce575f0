"""Keras files on the active backend: saved mid-cycle, a run resumes bit for
bit, and `load_model` gives back an `AccumulatingOptimizer`."""

from __future__ import annotations

import keras
import pytest

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import JIT, as_int, assert_same, make_data, make_mlp, values

N, B = 4, 4


def _everything(model, opt):
    """Weights, the wrapped optimizer's variables and the accumulation state."""
    return values(model.weights) + values(opt.variables)


def _uninterrupted(x, y, mode, jit):
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return model, opt


@pytest.mark.parametrize("jit", JIT)
def test_keras_file_saved_mid_cycle_resumes_bit_for_bit(tmp_path, mode, jit):
    x, y = make_data(B * 10)  # 2.5 cycles
    reference, ref_opt = _uninterrupted(x, y, mode, jit)

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    model.fit(x[:B * 6], y[:B * 6], batch_size=B, shuffle=False, verbose=0)
    assert as_int(opt.micro_step) == 2
    path = str(tmp_path / "mid_cycle.keras")
    model.save(path)

    loaded = keras.models.load_model(path, safe_mode=True)
    assert isinstance(loaded.optimizer, AccumulatingOptimizer)
    assert (loaded.optimizer.n, loaded.optimizer.mode) == (N, mode)
    loaded.fit(x[B * 6:], y[B * 6:], batch_size=B, shuffle=False, verbose=0)
    assert_same(_everything(reference, ref_opt), _everything(loaded, loaded.optimizer))


def test_weights_file_loaded_before_the_build_resumes_bit_for_bit(tmp_path, mode):
    """`load_weights` into a compiled model whose optimizer is not built yet:
    the values wait for the build (the first `fit`), the partial cycle
    included."""
    x, y = make_data(B * 10)
    reference, ref_opt = _uninterrupted(x, y, mode, JIT[0])

    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    model.compile(optimizer=opt, loss="mse", jit_compile=JIT[0])
    model.fit(x[:B * 6], y[:B * 6], batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "mid_cycle.weights.h5")
    model.save_weights(path)

    resumed = make_mlp()
    new_opt = accumulate(keras.optimizers.Adam(1e-2), N, mode=mode)
    resumed.compile(optimizer=new_opt, loss="mse", jit_compile=JIT[0])
    resumed.load_weights(path)
    assert not new_opt.built
    resumed.fit(x[B * 6:], y[B * 6:], batch_size=B, shuffle=False, verbose=0)
    assert_same(_everything(reference, ref_opt), _everything(resumed, new_opt))


def test_a_file_saved_with_another_n_is_refused(tmp_path):
    x, y = make_data(B * 6)
    model = make_mlp()
    model.compile(optimizer=accumulate(keras.optimizers.Adam(1e-2), N), loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "n4.weights.h5")
    model.save_weights(path)
    other = make_mlp()
    other.compile(optimizer=accumulate(keras.optimizers.Adam(1e-2), 2), loss="mse")
    with pytest.raises(ValueError, match=f"n={N}.*n=2"):
        other.load_weights(path)


def test_a_file_of_the_plain_optimizer_loads_with_an_empty_cycle(tmp_path):
    x, y = make_data(B * 8)
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=B * N, shuffle=False, verbose=0)
    path = str(tmp_path / "plain.weights.h5")
    model.save_weights(path)
    resumed = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N)
    resumed.compile(optimizer=opt, loss="mse")
    resumed.load_weights(path)
    resumed.fit(x[:B], y[:B], batch_size=B, shuffle=False, verbose=0)
    assert as_int(opt.micro_step) == 1
    assert as_int(opt.iterations) == 2
    # The slots are the plain optimizer's; the micro-batch changed none.
    assert_same(values(opt.__wrapped__.variables), values(model.optimizer.variables))


def _nadam_in_lso(wrapping):
    nadam = keras.optimizers.Nadam(1e-2)
    if wrapping == "accumulate(LSO)":
        return accumulate(keras.optimizers.LossScaleOptimizer(nadam), N)
    return keras.optimizers.LossScaleOptimizer(accumulate(nadam, N))


@pytest.mark.parametrize("wrapping", ["accumulate(LSO)", "LSO(accumulate)"])
def test_state_a_loss_scale_optimizer_hides_from_keras_files_is_kept(tmp_path, wrapping):
    # A LossScaleOptimizer builds its inner optimizer with Keras's tracking
    # off, so Nadam's `_u_product` is missing from `variables`, and Keras's
    # file of the plain LossScaleOptimizer(Nadam) loses it.
    x, y = make_data(B * 10)
    reference = make_mlp()
    reference.compile(optimizer=_nadam_in_lso(wrapping), loss="mse", jit_compile=JIT[0])
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    model = make_mlp()
    model.compile(optimizer=_nadam_in_lso(wrapping), loss="mse", jit_compile=JIT[0])
    model.fit(x[:B * 6], y[:B * 6], batch_size=B, shuffle=False, verbose=0)  # 1 update, 2 micro-steps
    path = str(tmp_path / "nadam.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    loaded.fit(x[B * 6:], y[B * 6:], batch_size=B, shuffle=False, verbose=0)
    assert_same(values(reference.weights), values(loaded.weights))


def test_hidden_state_saved_by_another_wrapping_is_refused():
    # A file of accumulate(LossScaleOptimizer(Nadam)) holds Nadam's hidden
    # `_u_product`; a bare accumulate(Nadam) lists it in `variables` and has
    # nowhere to put the extra value: refused, not dropped.
    model = make_mlp()
    opt = accumulate(keras.optimizers.Nadam(1e-2), N)
    opt.build(model.trainable_variables)
    store = {}
    opt.save_own_variables(store)
    store["gradaccum_untracked_0"] = store["gradaccum_micro_step"] * 0.0 + 0.5
    with pytest.raises(ValueError, match="another optimizer or wrapping"):
        opt.load_own_variables(store)


# ----------------------------------------------------------------------
# Configs.


def test_serialize_round_trip():
    opt = accumulate(keras.optimizers.SGD(0.1, momentum=0.5), 5, reduction="sum")
    config = keras.saving.serialize_keras_object(opt)
    assert config["class_name"] == "AccumulatingOptimizer"
    assert config["config"]["n"] == 5
    again = keras.saving.deserialize_keras_object(config)
    assert issubclass(type(again), AccumulatingOptimizer)
    assert (again.n, again.reduction) == (5, "sum")
    assert again.get_config()["momentum"] == 0.5
    also = AccumulatingOptimizer.from_config(config["config"])
    assert (also.n, also.reduction) == (5, "sum")
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).n == 5
    with pytest.raises(ValueError, match="needs \\['n'\\]"):
        AccumulatingOptimizer.from_config({"optimizer": config["config"]["optimizer"]})


def test_serialize_round_trip_through_loss_scale_optimizer():
    opt = accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), 4)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert issubclass(type(again), AccumulatingOptimizer)
    assert isinstance(again, keras.optimizers.LossScaleOptimizer)
    assert again.n == 4
    assert issubclass(type(again.inner_optimizer), AccumulatingOptimizer)
