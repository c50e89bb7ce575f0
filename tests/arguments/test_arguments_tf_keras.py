"""Bad input fails early, with the argument named, for tf_keras optimizers too."""


import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradaccum import AccumulatingOptimizer, accumulate
from tests.helpers import gradients, make_data, make_mlp
from tests.helpers.processes import run_python

MAKERS = [
    pytest.param(lambda: tf_keras.optimizers.Adam(1e-2), id="new"),
    pytest.param(lambda: tf_keras.optimizers.legacy.Adam(1e-2), id="legacy"),
]


@pytest.mark.parametrize("make", MAKERS)
def test_bad_n_and_reduction(make):
    with pytest.raises(ValueError, match="`n`"):
        accumulate(make(), 0)
    with pytest.raises(TypeError, match="`n`"):
        accumulate(make(), "3")
    with pytest.raises(TypeError, match="`n`"):
        accumulate(make(), True)
    with pytest.raises(ValueError, match="`reduction`"):
        accumulate(make(), 2, reduction="max")


@pytest.mark.parametrize("make", MAKERS)
def test_weigh_by_is_checked_and_kept(make):
    with pytest.raises(ValueError, match="`weigh_by`"):
        accumulate(make(), 2, weigh_by="tokens")
    assert accumulate(make(), 2, weigh_by="batch").weigh_by == "batch"
    scaled = accumulate(tf_keras.mixed_precision.LossScaleOptimizer(make()), 2, weigh_by="batch")
    assert scaled.weigh_by == "batch"


@pytest.mark.parametrize("make", MAKERS)
def test_wrapping_twice(make):
    with pytest.raises(ValueError, match="already an AccumulatingOptimizer"):
        accumulate(accumulate(make(), 2), 2)


def test_not_an_optimizer_names_the_tf_keras_families():
    with pytest.raises(TypeError, match="tf_keras") as info:
        accumulate(make_mlp(), 2)
    assert "`optimizer`" in str(info.value)


@pytest.mark.parametrize("make", MAKERS)
def test_unknown_apply_gradients_argument(make):
    model, opt = make_mlp(), accumulate(make(), 2)
    x, y = make_data(4)
    pairs = list(zip(gradients(model, x, y), model.trainable_variables))
    with pytest.raises(TypeError, match="'experimental_agregate_gradients'"):
        opt.apply_gradients(pairs, experimental_agregate_gradients=False)
    # The second positional argument is gradaccum's `weight`, not `name`.
    with pytest.raises(TypeError, match="`weight`"):
        opt.apply_gradients(pairs, "update")
    # Nothing was accumulated by the rejected calls.
    assert int(opt.micro_step) == 0


def test_gradient_for_a_variable_it_was_not_built_for():
    model, opt = make_mlp(), accumulate(tf_keras.optimizers.Adam(1e-2), 2)
    x, y = make_data(4)
    opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))
    other = tf.Variable(tf.zeros((3,)), name="stranger")
    with pytest.raises(ValueError, match="stranger"):
        opt.apply_gradients([(tf.ones((3,)), other)])


def test_legacy_optimizer_adds_a_variable_it_was_not_built_for():
    """As the plain OptimizerV2 does (it creates slots per variable)."""
    model, opt = make_mlp(), accumulate(tf_keras.optimizers.legacy.Adam(1e-2), 2)
    x, y = make_data(4)
    opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))
    other = tf.Variable(tf.zeros((3,)), name="stranger")
    opt.apply_gradients([(tf.ones((3,)), other)])  # ends the cycle
    assert int(opt.iterations) == 1
    assert len(opt.accumulation_state.accumulators) == len(model.trainable_variables) + 1
    # Half the summed gradient of the cycle, one Adam step (lr * sign).
    np.testing.assert_allclose(other.numpy(), -1e-2 * np.ones(3), rtol=1e-4)


def test_prebuilt_optimizer_given_other_variables():
    model = make_mlp()
    plain = tf_keras.optimizers.Adam(1e-2)
    plain.build(model.trainable_variables[:2])
    opt = accumulate(plain, 2)
    x, y = make_data(4)
    with pytest.raises(ValueError, match="out/kernel"):
        opt.apply_gradients(zip(gradients(model, x, y), model.trainable_variables))


@pytest.mark.parametrize("make", MAKERS)
def test_every_gradient_none(make):
    model, opt = make_mlp(), accumulate(make(), 2)
    with pytest.raises(ValueError, match="No gradients"):
        opt.apply_gradients([(None, v) for v in model.trainable_variables])


def test_keras3_optimizer_has_no_minimize_or_tf_keras_arguments():
    opt = accumulate(keras.optimizers.Adam(1e-2), 2)
    with pytest.raises(AttributeError, match="minimize"):
        opt.minimize(tf.constant(1.0), [], tape=None)
    with pytest.raises(TypeError, match="only `grads_and_vars`"):
        opt.apply_gradients([], name="update")


def test_import_gradaccum_does_not_import_tf_keras(monkeypatch):
    # TensorFlow imports tf_keras itself under TF_USE_LEGACY_KERAS=1.
    monkeypatch.delenv("TF_USE_LEGACY_KERAS")
    out = run_python(
        """
        import sys
        import gradaccum
        print("tf_keras" in sys.modules)
        """
    )
    assert out.split() == ["False"]


def test_first_call_in_a_process_wraps_a_tf_keras_loss_scale_optimizer():
    # The tf_keras adapters and loss-scale wrapper register on first use.
    out = run_python(
        """
        import tf_keras
        from gradaccum import AccumulatingOptimizer, accumulate
        LSO = tf_keras.mixed_precision.LossScaleOptimizer
        for make in (tf_keras.optimizers.Adam, tf_keras.optimizers.legacy.Adam):
            opt = accumulate(LSO(make()), 2)
            print(isinstance(opt.inner_optimizer, AccumulatingOptimizer))
        """
    )
    assert out.split() == ["True", "True"]


def test_accumulating_optimizer_is_the_tf_keras_optimizer():
    for make in (tf_keras.optimizers.Adam, tf_keras.optimizers.legacy.Adam):
        inner = make(1e-2)
        opt = accumulate(inner, 2)
        assert isinstance(opt, AccumulatingOptimizer)
        assert isinstance(opt, type(inner))
        assert tf_keras.optimizers.get(opt) is opt
        opt.learning_rate = 0.25
        assert float(tf_keras.backend.get_value(inner.learning_rate)) == 0.25


@pytest.mark.parametrize("make", MAKERS)
def test_micro_batch_size_is_refused_since_tf_keras_fit_is_not_split(make):
    with pytest.raises(ValueError, match=r"micro_batch_size=3.*tf_keras.*n=k"):
        accumulate(make(), micro_batch_size=3)
