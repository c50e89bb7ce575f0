"""The search of `micro_batch_size="auto"` measures a JAX train step compiled
without the backend's code optimised (`MEASURING_OPTIONS`), which is
cheaper; the bytes it reads must be those of the step as `fit` compiles it."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from keras import tree

from gradaccum import accumulate
from gradaccum._backend.memory import step_bytes


def _conv():
    return keras.Sequential([
        keras.Input((12, 12, 3)), keras.layers.Conv2D(8, 3), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4),
    ])


def _recurrent():
    inputs = keras.Input((10,), dtype="int32")
    hidden = keras.layers.LSTM(8)(keras.layers.Embedding(50, 8, mask_zero=True)(inputs))
    return keras.Model(inputs, keras.layers.Dense(4)(hidden))


@pytest.mark.parametrize("make_model, shape, dtype", [(_conv, (12, 12, 3), "float32"), (_recurrent, (10,), "int32")])
def test_measured_bytes_are_those_of_the_step_compiled_as_fit_compiles_it(make_model, shape, dtype):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 50, size=(32, *shape)).astype(dtype) if dtype == "int32" else rng.normal(
        size=(32, *shape)).astype(dtype)
    y = rng.integers(0, 4, size=32)
    model = make_model()
    model.compile(optimizer=accumulate(keras.optimizers.Adam(), micro_batch_size=8),
                  loss="sparse_categorical_crossentropy", jit_compile=True)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)

    def abstract(t):
        return None if t is None else jax.ShapeDtypeStruct(t.shape, t.dtype)

    lowered = jax.jit(model.train_step).lower(tree.map_structure(abstract, state), tree.map_structure(abstract, (x, y)))
    memory = lowered.compile().memory_analysis()
    expected = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes)
    assert step_bytes(model.train_step, state, (x, y)) == expected
