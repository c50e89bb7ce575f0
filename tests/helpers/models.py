"""Small models and data: the same few shapes in every suite.

Every constructor seeds Keras's random generators and names its layers, so
two calls give the same initial weights under the same variable names: a
reference and a subject model start alike. `lib` is the Keras module to
build with, `keras` (Keras 3) or `tf_keras`; by default the one TensorFlow
uses in this process (`tf_keras` under `TF_USE_LEGACY_KERAS=1`, the tfkeras
environment).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from tests.helpers.legacy import LEGACY


def default_library() -> Any:
    """`tf_keras` in a process that runs legacy Keras, else `keras`."""
    if LEGACY:
        import tf_keras

        return tf_keras
    return keras


def library_of(obj: Any) -> Any:
    """`tf_keras` for a tf_keras optimizer or model (wrapped or not), else `keras`."""
    obj = getattr(obj, "__wrapped__", obj)  # an AccumulatingOptimizer's
    if any(cls.__module__.split(".")[0] == "tf_keras" for cls in type(obj).__mro__):
        import tf_keras

        return tf_keras
    return keras


def make_data(samples: int, in_dim: int = 5, out_dim: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, in_dim)).astype("float32")
    y = rng.normal(size=(samples, out_dim)).astype("float32")
    return x, y


def make_mlp(
    in_dim: int = 5,
    out_dim: int = 3,
    widths: tuple[int, ...] = (8,),
    seed: int = 0,
    lib: Any = None,
    **dense_kwargs: Any,
) -> Any:
    """Dense layers `hidden0`, `hidden1`, ... (tanh) and `out`, in a model named "mlp"."""
    lib = lib or default_library()
    lib.utils.set_random_seed(seed)
    layers = [lib.Input((in_dim,))]
    for i, w in enumerate(widths):
        layers.append(lib.layers.Dense(w, activation="tanh", name=f"hidden{i}", **dense_kwargs))
    # tf_keras's mixed-precision tests keep the output in float32, as its
    # guide recommends; Keras 3's measured their tolerances with the policy's.
    out = {"dtype": "float32"} if lib is not keras else {}
    layers.append(lib.layers.Dense(out_dim, name="out", **out))
    return lib.Sequential(layers, name="mlp")


def make_float8_model() -> Any:
    """A Keras 3 model whose Dense `f8` is quantized to float8 (its scales
    and amax histories have `overwrite_with_gradient`), 8 inputs, 4 outputs."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="f8"), keras.layers.Dense(4, name="out")],
        name="float8",
    )
    model.layers[0].quantize("float8")
    return model


def make_embedding_model(vocab: int = 20, dim: int = 4, seed: int = 0, lib: Any = None) -> Any:
    """Embedding `emb` (3 ids per sample), flattened, and Dense `out` (2)."""
    lib = lib or default_library()
    lib.utils.set_random_seed(seed)
    inputs = lib.Input((3,), dtype="int32")
    h = lib.layers.Embedding(vocab, dim, name="emb")(inputs)
    h = lib.layers.Flatten()(h)
    out = lib.layers.Dense(2, name="out")(h)
    return lib.Model(inputs, out, name="embed")


def embedding_data(samples_per_cycle: int, cycles: int, unique_per_cycle: bool, vocab: int = 40):
    """Ids (3 per sample) and targets (2) for `make_embedding_model`.

    Keras 3 squares the values of an `IndexedSlices` gradient before summing
    repeated rows, so for Adam-like optimizers the large batch depends on
    how often a row repeats. `unique_per_cycle`: no id repeats within a
    cycle (the accumulated and the large batch's gradients then hold the
    same numbers); else ids from a few rows that repeat.
    """
    rng = np.random.default_rng(1)
    if unique_per_cycle:
        ids = [rng.permutation(vocab)[: samples_per_cycle * 3] for _ in range(cycles)]
        x = np.concatenate(ids).reshape(-1, 3).astype("int32")
    else:
        x = rng.integers(0, 8, size=(samples_per_cycle * cycles, 3)).astype("int32")
    y = rng.normal(size=(len(x), 2)).astype("float32")
    return x, y


@contextlib.contextmanager
def dtype_policy(name: str, lib: Any = None) -> Iterator[None]:
    """Sets the global dtype policy for the block, then restores it."""
    lib = lib or default_library()
    if lib is keras:
        get, set_ = keras.config.dtype_policy, keras.config.set_dtype_policy
    else:
        get, set_ = lib.mixed_precision.global_policy, lib.mixed_precision.set_global_policy
    previous = get()
    set_(name)
    try:
        yield
    finally:
        set_(previous)


# A masked token model: sequences of TOKENS_T ids below TOKENS_VOCAB, 0 masked.
TOKENS_T, TOKENS_VOCAB = 6, 11


def make_tokens_model() -> Any:
    """A seeded Embedding (mask_zero) and softmax Dense over each token."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS_T,), dtype="int32")
    h = keras.layers.Embedding(TOKENS_VOCAB, 3, mask_zero=True, name="emb")(inputs)
    outputs = keras.layers.Dense(4, activation="softmax", name="out")(h)
    return keras.Model(inputs, outputs, name="tokens")
