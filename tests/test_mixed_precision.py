"""Accumulation through LossScaleOptimizer, both wrapping orders."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from gradaccum import AccumulatingOptimizer, accumulate
from tests.support import (
    MODES,
    assert_states_close,
    dtype_policy,
    fit,
    full_state,
    make_data,
    make_mlp,
)

N, B, CYCLES = 3, 4, 3
LSO = keras.optimizers.LossScaleOptimizer
# Half-precision rounding: forward and backward passes round to a 10-bit
# (float16) or 7-bit (bfloat16) mantissa, and the micro-batch and large-batch
# runs round different partial sums. Two equivalent plain mixed_float16 runs of
# this MLP differ by ~2e-5 absolute; measured here 2.7e-5 (float16) and 3.5e-4
# (bfloat16, 8x coarser mantissa). A real bug moves values by ~lr = 1e-2.
FP16_ATOL, FP16_RTOL = 5e-5, 1e-4
BF16_ATOL, BF16_RTOL = 1e-3, 1e-3




def _adam():
    return keras.optimizers.Adam(1e-2)


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
@pytest.mark.parametrize("mode", MODES)
def test_fit_equals_large_batch_mixed_precision_training(policy_name, order, mode):
    x, y = make_data(B * N * CYCLES)
    with dtype_policy(policy_name):
        ref_model = make_mlp()
        ref_opt = LSO(_adam()) if policy_name == "mixed_float16" else _adam()
        fit(ref_model, ref_opt, x, y, B * N)
        model = make_mlp()
        opt = WRAPS[order](mode)
        fit(model, opt, x, y, B)
    if policy_name == "mixed_float16":
        assert isinstance(model.optimizer, LSO)
        assert model.optimizer.dynamic_scale.numpy() == ref_opt.dynamic_scale.numpy()
    ref = full_state(ref_model, ref_opt)
    acc = full_state(model, model.optimizer)
    assert acc["iterations"] == CYCLES
    if policy_name == "mixed_float16":
        # The scale's growth counter counts finite scaled backward passes:
        # micro-batches, not applied updates (documented).
        assert int(ref.pop("opt/step_counter")) == CYCLES
        assert int(acc.pop("opt/step_counter")) == N * CYCLES
    atol = FP16_ATOL if policy_name == "mixed_float16" else BF16_ATOL
    rtol = FP16_RTOL if policy_name == "mixed_float16" else BF16_RTOL
    assert_states_close(ref, acc, rtol=rtol, atol=atol)
    # Accumulators are float32 whatever the compute dtype.
    accumulating = opt if isinstance(opt, AccumulatingOptimizer) else opt.inner_optimizer
    state = accumulating.accumulation_state
    assert all(a.dtype == tf.float32 for a in state.accumulators)


def test_proxy_is_still_the_loss_scale_optimizer():
    inner = _adam()
    lso = LSO(inner, initial_scale=64.0)
    opt = accumulate(lso, 4)
    assert isinstance(opt, LSO)
    assert opt.__wrapped__ is lso
    assert isinstance(opt.inner_optimizer, AccumulatingOptimizer)
    assert opt.inner_optimizer.__wrapped__ is inner
    assert opt.n == 4 and opt.reduction == "mean"
    np.testing.assert_allclose(float(opt.scale_loss(tf.constant(1.0))), 64.0)
    opt.learning_rate = 0.25
    np.testing.assert_allclose(float(inner.learning_rate), 0.25)
    assert opt.iterations is inner.iterations
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(lso, 2)
    with pytest.raises(ValueError, match="accumulate twice"):
        accumulate(LSO(accumulate(_adam(), 2)), 2)


def _scaled_grads(model, opt, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
        scaled = opt.scale_loss(loss)
    return tape.gradient(scaled, model.trainable_variables)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["accumulate_lso", "lso_accumulate"])
@pytest.mark.parametrize("loop", ["eager", "tf_function"])
def test_non_finite_micro_batch_is_dropped(order, loop, mode):
    """Micro-batch 4 of 9 has a non-finite gradient.

    Reference: plain float32 training on large batches formed from the 8
    finite micro-batches (the dropped one is simply not there). The scale
    halves once and nothing else changes.
    """
    bad = 4
    x, y = make_data(B * (N * CYCLES + 1))
    micro = [(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)]
    finite = [m for k, m in enumerate(micro) if k != bad]
    xr = np.concatenate([m[0] for m in finite])
    yr = np.concatenate([m[1] for m in finite])
    ref_model, ref_opt = make_mlp(), _adam()
    fit(ref_model, ref_opt, xr, yr, B * N)

    model = make_mlp()
    opt = WRAPS[order](mode)
    lso = opt
    scale0 = 2.0**15

    def step(xb, yb, poison):
        grads = _scaled_grads(model, lso, xb, yb)
        grads = [tf.where(poison, g * np.inf, g) for g in grads]
        lso.apply_gradients(zip(grads, model.trainable_variables))

    if loop == "tf_function":
        step = tf.function(step)
    micro_steps = []
    for k, (xb, yb) in enumerate(micro):
        step(xb, yb, tf.constant(k == bad))
        core = opt if order == "accumulate_lso" else opt.inner_optimizer
        micro_steps.append(int(core.micro_step))
    # The dropped micro-batch does not advance the cycle.
    assert micro_steps == [1, 2, 0, 1, 1, 2, 0, 1, 2, 0]
    np.testing.assert_allclose(float(lso.dynamic_scale), scale0 / 2)
    ref = full_state(ref_model, ref_opt)
    acc = full_state(model, lso.inner_optimizer)
    assert acc["iterations"] == CYCLES
    assert_states_close(ref, acc)
