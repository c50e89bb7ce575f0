"""Mixed precision through Keras's `LossScaleOptimizer` on the active
backend, both wrapping orders, and a non-finite micro-batch dropped."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import (
    BACKEND,
    as_int,
    assert_states_close,
    core_of,
    dtype_policy,
    fit,
    full_state,
    gradients,
    make_data,
    make_mlp,
)

N, B, CYCLES = 3, 4, 3
LSO = keras.optimizers.LossScaleOptimizer
# Half-precision rounding: forward and backward passes round to a 10-bit
# (float16) or 7-bit (bfloat16) mantissa, and the micro-batch and large-batch
# runs round different partial sums. Measured without gradaccum: plain Adam
# applying the mean of the three float16 micro-batch gradients ends 2.7e-5
# (TensorFlow), 6.3e-5 (JAX) and 3.7e-5 (PyTorch) from the large batch in
# Adam's first moment; bfloat16, with an 8x coarser mantissa, 3.5e-4
# (TensorFlow). A real bug moves values by ~lr = 1e-2.
FP16_ATOL = 5e-5 if BACKEND == "tensorflow" else 1e-4
FP16_RTOL = 1e-4
BF16_ATOL, BF16_RTOL = 1e-3, 1e-3


def _adam():
    return keras.optimizers.Adam(1e-2)


def _assert_equals_reference(policy_name, ref_model, ref_opt, model):
    """The mixed-precision run of `model` equals the large batch's
    (`ref_model`, `ref_opt`) within half-precision rounding, after CYCLES
    updates of N micro-batches each."""
    ref = full_state(ref_model, ref_opt)
    acc = full_state(model, model.optimizer)
    assert acc["iterations"] == CYCLES
    if policy_name == "mixed_float16":
        assert isinstance(model.optimizer, LSO)
        # No micro-batch overflowed: the scale is where the reference's is.
        assert float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale)) == float(
            keras.ops.convert_to_numpy(ref_opt.dynamic_scale)
        )
        # The scale's growth counter counts finite scaled backward passes:
        # micro-batches, not applied updates (documented).
        assert int(ref.pop("opt/step_counter")) == CYCLES
        assert int(acc.pop("opt/step_counter")) == N * CYCLES
        atol, rtol = FP16_ATOL, FP16_RTOL
    else:
        atol, rtol = BF16_ATOL, BF16_RTOL
    assert_states_close(ref, acc, rtol=rtol, atol=atol)


WRAPS = {
    "accumulate_lso": lambda mode: accumulate(LSO(_adam()), N, mode=mode),
    "lso_accumulate": lambda mode: LSO(accumulate(_adam(), N, mode=mode)),
    "compile_auto_wrap": lambda mode: accumulate(_adam(), N, mode=mode),  # compile adds the LSO
}


@pytest.mark.parametrize(
    "policy_name, order",
    [("mixed_float16", order) for order in sorted(WRAPS)]
    # Keras adds no loss scaling for bfloat16.
    + [("mixed_bfloat16", "compile_auto_wrap")],
)
def test_fit_equals_large_batch_mixed_precision_training(policy_name, order, mode):
    x, y = make_data(B * N * CYCLES)
    with dtype_policy(policy_name):
        ref_model = make_mlp()
        ref_opt = LSO(_adam()) if policy_name == "mixed_float16" else _adam()
        fit(ref_model, ref_opt, x, y, B * N)
        model = make_mlp()
        opt = WRAPS[order](mode)
        fit(model, opt, x, y, B)
    _assert_equals_reference(policy_name, ref_model, ref_opt, model)
    # Accumulators are float32 whatever the compute dtype.
    core = core_of(model.optimizer)
    assert all(keras.backend.standardize_dtype(a.dtype) == "float32" for a in core.accumulation_state.accumulators)


@pytest.mark.parametrize("order", ["accumulate_lso", "lso_accumulate"])
def test_non_finite_micro_batch_is_dropped(order, mode):
    """Micro-batch 4 of 10 has a non-finite gradient. Reference: plain
    float32 training on the large batches of the 9 finite micro-batches.
    The scale halves once and the cycle waits for a finite micro-batch."""
    bad = 4
    x, y = make_data(B * (N * CYCLES + 1))
    micro = [(x[i:i + B], y[i:i + B]) for i in range(0, len(x), B)]
    finite = [m for k, m in enumerate(micro) if k != bad]
    ref_model, ref_opt = make_mlp(), _adam()
    fit(ref_model, ref_opt, np.concatenate([m[0] for m in finite]), np.concatenate([m[1] for m in finite]), B * N)

    model = make_mlp()
    lso = WRAPS[order](mode)
    lso.build(model.trainable_variables)
    core = core_of(lso)
    mse = keras.losses.MeanSquaredError()

    def scaled(y_true, y_pred, sample_weight=None):
        return lso.scale_loss(mse(y_true, y_pred))

    micro_steps = []
    for k, (xb, yb) in enumerate(micro):
        grads = gradients(model, xb, yb, loss=scaled)
        if k == bad:
            grads = [g * np.inf for g in grads]
        _apply(lso, grads, model.trainable_variables)
        micro_steps.append(as_int(core.micro_step))
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(lso.dynamic_scale)), 2.0**15 / 2)
    acc = full_state(model, lso.inner_optimizer)
    assert acc["iterations"] == CYCLES
    assert_states_close(full_state(ref_model, ref_opt), acc)


def _apply(optimizer, grads, variables):
    """One step the way the backend's `fit` takes it: on JAX
    `stateless_apply` (Keras's loss-scale optimizer's stateful `apply`
    cannot run on JAX), elsewhere `apply`."""
    if BACKEND != "jax":
        optimizer.apply(grads, variables)
        return
    new_values, new_state = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], grads, [v.value for v in variables]
    )
    for v, value in zip(variables, new_values):
        v.assign(value)
    for v, value in zip(optimizer.variables, new_state):
        v.assign(value)


def test_proxy_is_still_the_loss_scale_optimizer():
    inner = _adam()
    lso = LSO(inner, initial_scale=64.0)
    opt = accumulate(lso, 4)
    assert isinstance(opt, LSO)
    assert opt.__wrapped__ is lso
    assert isinstance(opt.inner_optimizer, AccumulatingOptimizer)
    assert opt.inner_optimizer.__wrapped__ is inner
    assert opt.n == 4 and opt.reduction == "mean"
    scaled = opt.scale_loss(keras.ops.convert_to_tensor(1.0))
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(scaled)), 64.0)
    opt.learning_rate = 0.25
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(inner.learning_rate)), 0.25)
    assert opt.iterations is inner.iterations
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(lso, 2)
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(LSO(accumulate(_adam(), 2)), 2)


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_split_step_equals_large_batch_mixed_precision_training(policy_name):
    """`micro_batch_size`: each batch of `fit` computed in micro-batches
    inside the train step under a mixed policy; `compile` puts Keras's loss
    scaling (float16) around the accumulating optimizer. Same tolerances as
    above: the same half-precision rounding of other partial sums."""
    x, y = make_data(B * N * CYCLES)
    with dtype_policy(policy_name):
        ref_model = make_mlp()
        ref_opt = LSO(_adam()) if policy_name == "mixed_float16" else _adam()
        fit(ref_model, ref_opt, x, y, B * N)
        model = make_mlp()
        fit(model, accumulate(_adam(), micro_batch_size=B), x, y, B * N)
    _assert_equals_reference(policy_name, ref_model, ref_opt, model)
