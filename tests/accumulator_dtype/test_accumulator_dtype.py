"""`accumulator_dtype="bfloat16"`: compensated sums in bfloat16 on the active backend."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import accumulate
from tests.helpers import (
    JIT,
    assert_same,
    assert_states_close,
    fit_pair,
    internal_state,
    make_data,
    make_mlp,
    settings_of,
    values,
)


def test_accumulators_and_compensations_are_bfloat16():
    model = make_mlp()
    opt = accumulate(keras.optimizers.SGD(0.1), 4, accumulator_dtype="bfloat16")
    opt.build(model.trainable_variables)
    dtypes = {keras.backend.standardize_dtype(a.dtype) for a in opt.accumulation_state.accumulators}
    assert dtypes == {"bfloat16"}
    state = internal_state(opt)
    assert {keras.backend.standardize_dtype(c.dtype) for c in state.compensations} == {"bfloat16"}


def test_fit_equals_the_large_batch_to_the_compensated_precision():
    """Against the plain optimizer on the large batch. The compensated sum
    keeps about 16 significant bits (2^-16 = 1.5e-5 relative, where float32
    keeps 2^-24), so this compares at 1e-4 relative, not float32's 1e-5."""
    ref, acc, _, _ = fit_pair(
        lambda: keras.optimizers.Adam(1e-2), n=8, wrap=lambda o, n: accumulate(o, n, accumulator_dtype="bfloat16")
    )
    assert_states_close(ref, acc, rtol=1e-4, atol=1e-6)


def test_compensation_keeps_what_a_bfloat16_sum_loses():
    """32 micro-gradients of a bfloat16 variable, applied by SGD(1): the
    update is their mean. Against the exact mean (float64), the compensated
    sum's error stays near float32's and far below a plain bfloat16 sum's,
    which rounds at each of the 32 additions."""
    n = 32
    rng = np.random.default_rng(0)
    grads = [keras.ops.convert_to_numpy(keras.ops.cast(rng.normal(1.0, 0.5, size=(256,)), "bfloat16"))
             for _ in range(n)]
    exact = np.mean([g.astype(np.float64) for g in grads], axis=0)
    plain = np.zeros(256, dtype=grads[0].dtype)
    for g in grads:  # the sum a bfloat16 accumulator without compensation holds
        plain = (plain.astype(np.float32) + g.astype(np.float32)).astype(grads[0].dtype)
    plain_error = np.max(np.abs(plain.astype(np.float64) / n - exact) / np.abs(exact))

    errors = {}
    for dtype in ("float32", "bfloat16"):
        variable = keras.Variable(np.zeros(256, "float32"), dtype="float32")
        opt = accumulate(keras.optimizers.SGD(1.0), n, accumulator_dtype=dtype)
        opt.build([variable])
        for g in grads:
            opt.apply([keras.ops.convert_to_tensor(g.astype(np.float32))], [variable])
        update = -np.asarray(keras.ops.convert_to_numpy(variable), np.float64)
        errors[dtype] = np.max(np.abs(update - exact) / np.abs(exact))
    assert errors["float32"] < 1e-6
    assert errors["bfloat16"] < 2.0**-15
    assert errors["bfloat16"] < plain_error / 20, (errors, plain_error)


@pytest.mark.parametrize("jit", JIT)
def test_a_keras_file_saved_mid_cycle_resumes_bit_for_bit(tmp_path, jit):
    B, n = 4, 4
    x, y = make_data(B * 10)

    def compiled():
        model = make_mlp()
        opt = accumulate(keras.optimizers.Adam(1e-2), n, accumulator_dtype="bfloat16")
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        return model, opt

    reference, ref_opt = compiled()
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    model, _ = compiled()
    model.fit(x[: B * 6], y[: B * 6], batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "bfloat16.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    assert settings_of(loaded.optimizer)["accumulator_dtype"] == "bfloat16"
    loaded.fit(x[B * 6 :], y[B * 6 :], batch_size=B, shuffle=False, verbose=0)
    assert_same(values(reference.weights), values(loaded.weights))
    assert_same(values(internal_state(ref_opt).compensations), values(internal_state(loaded.optimizer).compensations))
