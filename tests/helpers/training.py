"""Gradients, training runs and the large-batch reference runs.

A reference run trains the plain optimizer on batches of `B * n`; the
subject run trains `accumulate(optimizer, n)` on micro-batches of `B`. Both
start from the same initial weights (same model constructor) and see the
data in the same order, so their weights, optimizer variables and
`iterations` must agree to float32 rounding.

Gradients are taken the active backend's way (`gradients_of`), so the same
test runs on TensorFlow, JAX and PyTorch; tf_keras models take TensorFlow's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from tests.helpers.models import library_of, make_data, make_mlp
from tests.helpers.state import full_state

BACKEND = keras.config.backend()

# `jit_compile` values `fit` is tested with where the backend decides: JAX
# traces with and without XLA; PyTorch runs eagerly; TensorFlow's own
# suite covers its execution modes (tests/training/test_semantics_tensorflow.py), so one
# suffices there.
JIT = {"jax": (True, False)}.get(BACKEND, (False,))


def gradients_of(model: Any, x: Any, loss_of: Callable[[Any], Any]) -> list[Any]:
    """The gradients of `loss_of(model outputs on x)` for the model's
    trainable variables, taken the active backend's way, as backend tensors;
    `None` for a variable the loss does not reach (JAX: zeros)."""
    variables = model.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_of(model(x, training=True))
        return tape.gradient(value, variables)
    if BACKEND == "jax":
        import jax

        others = [v.value for v in model.non_trainable_variables]

        def of(values: list[Any]) -> Any:
            y_pred, _ = model.stateless_call(values, others, x, training=True)
            return loss_of(y_pred)

        return jax.grad(of)([v.value for v in variables])
    import torch

    value = loss_of(model(x, training=True))
    return list(torch.autograd.grad(value, [v.value for v in variables], allow_unused=True))


def gradients(model: Any, x: Any, y: Any, loss: Any = None, sample_weight: Any = None) -> list[Any]:
    """The gradients of `loss` (the model's library's mean squared error by
    default) on `(x, y)` for the model's trainable variables."""
    loss = loss or library_of(model).losses.MeanSquaredError()
    return gradients_of(model, x, lambda y_pred: loss(y, y_pred, sample_weight=sample_weight))


def split(x: np.ndarray, y: np.ndarray, sizes: int | Sequence[int]) -> list[tuple[Any, Any]]:
    """Consecutive `(x, y)` batches: of `sizes` samples each, or of the sizes listed."""
    if isinstance(sizes, int):
        sizes = [sizes] * (len(x) // sizes) + ([len(x) % sizes] if len(x) % sizes else [])
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def concat(batches: Sequence[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """One batch of the given `(x, y)` batches, in order."""
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def train_steps(
    model: Any,
    optimizer: Any,
    batches: Sequence[tuple[Any, Any]],
    loss: Any = None,
    weights: Sequence[Any] | None = None,
    entry: str = "apply",
) -> dict[str, np.ndarray]:
    """One update call per `(x, y)` batch, with the gradients of `loss` (see
    `gradients`), weighted by `weights[i]` if given; returns the state.

    `entry` is the Keras 3 method called: `apply(grads, variables)` or
    `apply_gradients(zip(grads, variables))`.
    """
    for i, (x, y) in enumerate(batches):
        grads = gradients(model, x, y, loss=loss)
        kwargs = {} if weights is None else {"weight": weights[i]}
        if entry == "apply":
            optimizer.apply(grads, model.trainable_variables, **kwargs)
        else:
            optimizer.apply_gradients(zip(grads, model.trainable_variables), **kwargs)
    return full_state(model, optimizer)


def fit(
    model: Any,
    optimizer: Any,
    x: Any,
    y: Any,
    batch_size: int,
    loss: Any = "mse",
    epochs: int = 1,
    fit_kwargs: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> Any:
    """Compiles and fits a Keras 3 or tf_keras model, unshuffled.

    `fit_kwargs` go to `fit` (sample weights, callbacks), the rest to `compile`.
    """
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **(fit_kwargs or {}))
    return model


def fit_pair(
    make_optimizer: Callable[[], Any],
    n: int,
    micro_batch: int = 4,
    cycles: int = 3,
    make_model: Callable[[], Any] | None = None,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    loss: Any = "mse",
    wrap: Callable[[Any, int], Any] | None = None,
    mode: str = "masked",
    fit_kwargs: dict[str, Any] | None = None,
    subject_callbacks: Sequence[Any] = (),
    **compile_kwargs: Any,
):
    """Trains the reference (batch B*n) and the subject (batch B) with `fit`.

    The subject is `accumulate(optimizer, n, mode=mode)` unless `wrap` says
    otherwise; the model is `make_mlp` of the optimizer's library unless
    `make_model` says otherwise. `fit_kwargs` go to both `fit` calls, and
    `subject_callbacks` to the subject's only. Returns `(reference_state,
    subject_state, subject_model, subject_opt)`.
    """
    from gradaccum import accumulate

    wrap = wrap or (lambda opt, n: accumulate(opt, n, mode=mode))
    if data is None:
        data = make_data(micro_batch * n * cycles)
    x, y = data
    ref_opt = make_optimizer()
    make_model = make_model or functools.partial(make_mlp, lib=library_of(ref_opt))
    ref_model = make_model()
    fit(ref_model, ref_opt, x, y, micro_batch * n, loss=loss, fit_kwargs=fit_kwargs, **compile_kwargs)
    model = make_model()
    opt = wrap(make_optimizer(), n)
    subject_kwargs = dict(fit_kwargs or {}, callbacks=list(subject_callbacks))
    fit(model, opt, x, y, micro_batch, loss=loss, fit_kwargs=subject_kwargs, **compile_kwargs)
    return full_state(ref_model, ref_opt), full_state(model, opt), model, opt


def core_of(optimizer: Any) -> Any:
    """The `AccumulatingOptimizer` that holds the accumulators.

    `optimizer` itself, or the `inner_optimizer` of a loss-scale optimizer
    around it (`LossScaleOptimizer(accumulate(opt))`) or of the front that
    `accumulate(LossScaleOptimizer(opt))` returns.
    """
    from gradaccum import AccumulatingOptimizer

    core = getattr(optimizer, "inner_optimizer", optimizer)
    assert isinstance(core, AccumulatingOptimizer), type(core)
    return core


def settings_of(optimizer: Any) -> dict[str, Any]:
    """An accumulating optimizer's settings, as its Keras config carries
    them (every keyword argument of `accumulate()` by name)."""
    return keras.saving.serialize_keras_object(optimizer)["config"]


def internal_core(optimizer: Any) -> Any:
    """The accumulating core behind `optimizer` (`gradaccum._core.Core`).
    The one place tests read the proxy's internals."""
    return core_of(optimizer)._self_core


def internal_state(optimizer: Any) -> Any:
    """The accumulation state behind `optimizer` (`gradaccum._state.State`),
    for what `accumulation_state` does not show: the compensations of
    `accumulator_dtype="bfloat16"`, the buffers of kept slices."""
    return internal_core(optimizer).state


def as_int(value: Any) -> int:
    """A counter (`micro_step`, `iterations`) of any backend as an int."""
    return int(keras.ops.convert_to_numpy(value))
