"""Shared helpers: small models, data, and the large-batch reference.

A reference run trains the plain optimizer on batch `B * n`; the subject run
trains `accumulate(optimizer, n)` on micro-batch `B`. Both start from the same
initial weights (same seed, same layer names) and see the data in the same
order, so their weights, optimizer variables and `iterations` must agree to
float32 rounding.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

# Float32 rounding after a few cycles on these small models: measured noise
# between equivalent runs is 3e-8..3e-7 absolute; relative 1e-5 covers values
# far from zero (Adam's second moments are ~1e-5 in size).
RTOL = 1e-5
ATOL = 1e-6

# Every `mode` of `accumulate`: equivalence tests run once per mode.
MODES = ("masked", "skip")


def shipped_optimizers() -> set[str]:
    """Names of the optimizers `keras.optimizers` ships (wrappers excluded)."""
    wrappers = {"Optimizer", "LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"}
    return {
        name
        for name, obj in vars(keras.optimizers).items()
        if inspect.isclass(obj)
        and issubclass(obj, keras.optimizers.Optimizer)
        and name not in wrappers
    }


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
    **dense_kwargs: Any,
) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((in_dim,))]
    for i, w in enumerate(widths):
        layers.append(
            keras.layers.Dense(w, activation="tanh", name=f"hidden{i}", **dense_kwargs)
        )
    layers.append(keras.layers.Dense(out_dim, name="out"))
    return keras.Sequential(layers, name="mlp")


def make_embedding_model(vocab: int = 20, dim: int = 4, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="emb")(inputs)
    h = keras.layers.Flatten()(h)
    out = keras.layers.Dense(2, name="out")(h)
    return keras.Model(inputs, out, name="embed")


def optimizer_state(optimizer: Any, model_name: str = "") -> dict[str, np.ndarray]:
    """Every optimizer variable by the last part of its path.

    The leading parts name the optimizer (and a loss-scale wrapper), which
    differ between the runs compared; slot names start with the model's name
    in a model built in Python, not in one loaded from a file.
    """
    out = {}
    for v in optimizer.variables:
        if v.path.rsplit("/", 1)[-1].startswith("gradaccum_"):
            # The accumulation state, which the proxy lists after the wrapped
            # optimizer's variables on JAX and PyTorch: no plain optimizer
            # has it.
            continue
        # Unnamed variables get a process-wide counter suffix ("variable_3");
        # drop it, and number repeats in creation order instead.
        path = re.sub(r"_\d+$", "", v.path.rsplit("/", 1)[-1])
        if model_name and path.startswith(model_name + "_"):
            path = path[len(model_name) + 1 :]
        key, k = f"opt/{path}", 1
        while key in out:
            key, k = f"opt/{path}#{k}", k + 1
        out[key] = np.asarray(v.numpy())
    return out


def full_state(model: keras.Model, optimizer: Any) -> dict[str, np.ndarray]:
    """Model weights (by layer/name) and optimizer variables (by name)."""
    out = {
        "model/" + "/".join(v.path.split("/")[-2:]): np.asarray(v.numpy())
        for v in model.weights
    }
    out.update(optimizer_state(optimizer, model.name))
    iterations = optimizer.iterations
    # A variable, or (Keras's own accumulation on JAX) a computed array.
    value = iterations.numpy() if hasattr(iterations, "numpy") else keras.ops.convert_to_numpy(iterations)
    out["iterations"] = np.asarray(int(value))
    return out


def assert_states_close(
    reference: dict[str, np.ndarray],
    subject: dict[str, np.ndarray],
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    assert sorted(reference) == sorted(subject), (
        sorted(set(reference) ^ set(subject))
    )
    for key in reference:
        np.testing.assert_allclose(
            subject[key], reference[key], rtol=rtol, atol=atol, err_msg=key
        )


def assert_states_equal(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert sorted(before) == sorted(after)
    for key in before:
        assert np.array_equal(before[key], after[key]), key


def fit(
    model: Any,
    optimizer: Any,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    loss: Any = "mse",
    epochs: int = 1,
    **compile_kwargs: Any,
) -> Any:
    """Compiles and fits a Keras 3 or tf_keras model, unshuffled."""
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def fit_pair(
    make_optimizer: Callable[[], Any],
    n: int,
    micro_batch: int = 4,
    cycles: int = 3,
    make_model: Callable[[], keras.Model] = make_mlp,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    loss: Any = "mse",
    wrap: Callable[[Any, int], Any] | None = None,
    mode: str = "masked",
    **compile_kwargs: Any,
):
    """Trains reference (batch B*n) and subject (accumulate, batch B) with fit.

    The subject is `accumulate(optimizer, n, mode=mode)` unless `wrap` says
    otherwise. Returns `(reference_state, subject_state, subject_model,
    subject_opt)`.
    """
    from gradaccum import accumulate

    wrap = wrap or (lambda opt, n: accumulate(opt, n, mode=mode))
    if data is None:
        data = make_data(micro_batch * n * cycles)
    x, y = data
    ref_model = make_model()
    ref_opt = make_optimizer()
    fit(ref_model, ref_opt, x, y, micro_batch * n, loss=loss, **compile_kwargs)
    model = make_model()
    opt = wrap(make_optimizer(), n)
    fit(model, opt, x, y, micro_batch, loss=loss, **compile_kwargs)
    return full_state(ref_model, ref_opt), full_state(model, opt), model, opt


def mse_grads(model: keras.Model, x, y, loss_fn=None):
    import tensorflow as tf

    loss_fn = loss_fn or keras.losses.MeanSquaredError()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


_MIRRORED: list[tf.distribute.MirroredStrategy] = []


def mirrored() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy over the two logical CPUs, shared by all tests.

    Several MirroredStrategy objects in one process hand out the same
    collective instance keys, so their all-reduces can meet each other.
    """
    import tensorflow as tf

    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


@contextlib.contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    """Sets Keras's global dtype policy for the block, then restores it."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
