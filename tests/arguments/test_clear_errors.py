"""Mistakes a newcomer makes get gradaccum's own errors, naming what is wrong."""

from __future__ import annotations

import keras
import pytest

from gradaccum import accumulate
from tests.helpers import make_mlp


def test_a_gradient_of_the_wrong_shape_names_its_variable():
    model = make_mlp(in_dim=3, out_dim=2, widths=())
    opt = accumulate(keras.optimizers.SGD(0.1), 2)
    kernel, bias = model.trainable_variables
    grads = [keras.ops.ones((3, 3)), keras.ops.ones((2,))]
    with pytest.raises(ValueError, match=f"'{kernel.path}' has shape \\(3, 3\\).*\\(3, 2\\)"):
        opt.apply(grads, model.trainable_variables)


def test_compiling_with_the_decorator_explains_what_to_pass():
    model = make_mlp()
    with pytest.raises(TypeError, match=r"accumulate\(n=4\) without an optimizer.*decorator"):
        model.compile(optimizer=accumulate(n=4), loss="mse")
    # The decorator itself still works as documented.
    assert accumulate(n=4)(keras.optimizers.SGD)(0.1).n == 4


def test_weight_for_a_plain_loss_scale_optimizer_is_refused_by_name():
    accumulate(keras.optimizers.SGD(0.1), 2)  # gradaccum in use
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="'weight'.*accumulating optimizer"):
        lso.apply_gradients([], weight=2.0)
