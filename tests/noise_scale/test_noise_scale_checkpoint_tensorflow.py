"""The noise scale's state and bfloat16 compensations in TensorFlow checkpoints, mid-cycle."""

import keras
import numpy as np
import tensorflow as tf

from gradaccum import accumulate
from tests.helpers import gradients as mse_grads
from tests.helpers import make_data, make_mlp

B, N = 4, 3


def _run(opt, model, x, y, steps):
    for k in steps:
        opt.apply(mse_grads(model, x[k * B : (k + 1) * B], y[k * B : (k + 1) * B]), model.trainable_variables)


def _compiled():
    model = make_mlp()
    opt = accumulate(keras.optimizers.Adam(1e-2), N, noise_scale=True, accumulator_dtype="bfloat16")
    opt.build(model.trainable_variables)
    return model, opt


def test_a_checkpoint_mid_cycle_resumes_the_measurement(tmp_path):
    x, y = make_data(B * N * 4)
    reference, ref_opt = _compiled()
    _run(ref_opt, reference, x, y, range(N * 4))

    model, opt = _compiled()
    _run(opt, model, x, y, range(2 * N + 1))  # two cycles and one micro-batch
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    restored, restored_opt = _compiled()
    tf.train.Checkpoint(model=restored, optimizer=restored_opt).restore(path).assert_consumed()
    assert restored_opt.accumulation_state.noise_cycles == 2
    _run(restored_opt, restored, x, y, range(2 * N + 1, N * 4))
    expected, got = ref_opt.accumulation_state, restored_opt.accumulation_state
    assert got.noise_cycles == expected.noise_cycles == 4
    for field in ("noise_scale", "gradient_sq", "gradient_trace"):
        assert getattr(got, field) == getattr(expected, field), field
    for a, b in zip(reference.weights, restored.weights):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
