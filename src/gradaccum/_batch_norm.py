"""BatchNormalization that follows the accumulation cycle.

Under accumulation, Keras's `BatchNormalization` updates its moving mean and
variance on every micro-batch, `n` times per applied update, each time from
one micro-batch's statistics. Training on the large batch updates them once
per update, from the large batch's statistics. `BatchNormalization` here
reproduces that:

- Training normalizes with the micro-batch's own mean and variance, as the
  large batch's layer normalizes with its own (those are not the same
  numbers; nothing can make a micro-batch see the large batch's moments
  without a second pass).
- Every micro-batch adds its count, mean and variance to the cycle's pooled
  statistics (three non-trainable weights, so checkpoints and Keras files
  hold a partial cycle), merged as in Chan et al.'s parallel variance
  algorithm: weighted by count, and with the spread between micro-batch
  means, so the pool is the mean and (biased) variance of all the cycle's
  samples, ragged micro-batches included.
- On the cycle's last micro-batch (the optimizer's `will_apply`, read in
  the forward pass, before the optimizer's step in the same train step
  advances its counter) the moving statistics take Keras's update,
  `moving * momentum + pooled * (1 - momentum)`, once, and the pool is
  emptied. Both are branch-free selects, so nothing that synchronises
  replicas (`synchronized=True`) sits in a branch.

The layer finds the cycle through the model: `Model.compile` and
`make_train_function` point every such layer in the model at the model's
accumulating optimizer (`follow`); `flush()` of that optimizer applies the
pool too. Without one, the layer is Keras's own.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.backend.common.variables import AutocastScope

from gradaccum import _backend, _families, _patches


@keras.saving.register_keras_serializable(package="gradaccum", name="BatchNormalization")
class BatchNormalization(keras.layers.BatchNormalization):
    """Keras's `BatchNormalization`, with moving statistics per update.

    A drop-in subclass of `keras.layers.BatchNormalization` with the same
    arguments. In a model compiled with an accumulating optimizer
    (`gradaccum.accumulate`) it updates its moving mean and variance once per
    applied update, with the pooled statistics of the cycle's micro-batches
    (the mean of all their samples and their variance, including the spread
    between micro-batch means), as Keras's layer does on the large batch.
    Training still normalizes each micro-batch with its own statistics.
    Without an accumulating optimizer (or with `n=1`) it is Keras's layer.

    It follows the optimizer's cycle by itself: `n`, a schedule of `n`,
    `flush()`. A custom loop whose model is not compiled with the optimizer
    calls `gradaccum.layers.follow(model, optimizer)` first.

    Args:
        **kwargs: Those of `keras.layers.BatchNormalization`. `renorm=True`
            is refused (batch renormalization corrects with moving
            statistics that would move per micro-batch).

    Raises:
        ValueError: If `renorm=True`, or the Keras backend is not
            TensorFlow.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        if keras.config.backend() != "tensorflow":
            # On JAX, `fit` calls a layer with its model's variables only: the
            # optimizer's cycle, which the pooled update follows, is not
            # among them.
            raise ValueError(
                "gradaccum.layers.BatchNormalization runs on the TensorFlow "
                f"backend only; the active Keras backend is {keras.config.backend()!r}. "
                "Use keras.layers.BatchNormalization."
            )
        if kwargs.get("renorm"):
            raise ValueError(
                "gradaccum.layers.BatchNormalization does not support "
                "`renorm=True`; use keras.layers.BatchNormalization for it."
            )
        super().__init__(*args, **kwargs)
        # Weak references to the core followed and the model whose
        # optimizer runs it, or None.
        self._gradaccum_cycle: Any = None
        self._gradaccum_model: Any = None
        self._gradaccum_optimizer: Any = None

    def build(self, input_shape: Any) -> None:
        super().build(input_shape)
        shape = (input_shape[self.axis],)
        # Written in replica context, so they need an aggregation; with
        # `synchronized=True` every replica holds the same pool anyway.
        self.pooled_count = self.add_weight(
            shape=(), name="pooled_count", initializer="zeros", trainable=False,
            autocast=False, aggregation="mean",
        )
        self.pooled_mean = self.add_weight(
            shape=shape, name="pooled_mean", initializer="zeros", trainable=False,
            autocast=False, aggregation="mean",
        )
        self.pooled_m2 = self.add_weight(
            shape=shape, name="pooled_m2", initializer="zeros", trainable=False,
            autocast=False, aggregation="mean",
        )

    # ------------------------------------------------------------------

    def _followed(self) -> Any:
        ref = self._gradaccum_cycle
        return None if ref is None else ref()

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        accumulation = self._followed()
        if not (training and self.trainable) or accumulation is None or accumulation.cycle.hands_over():
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            return super().call(inputs, training=training, mask=mask)  # Keras raises
        if not accumulation.built:
            if in_symbolic_scope():
                # Keras works out output shapes; nothing runs.
                return super().call(inputs, training=training, mask=mask)
            self._build_optimizer()
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = keras.ops.cast(inputs, compute_dtype)
        gamma = keras.ops.cast(self.gamma, compute_dtype) if self.scale else None
        beta = keras.ops.cast(self.beta, compute_dtype) if self.center else None
        mean, variance = self._moments(inputs, mask)
        self._pool(mean, variance, self._count(inputs, mask), accumulation.will_apply())
        outputs = keras.ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis,
            offset=beta, scale=gamma, epsilon=self.epsilon,
        )
        return keras.ops.cast(outputs, self.compute_dtype)

    def _build_optimizer(self) -> None:
        """Builds the followed optimizer for its model's variables.

        `model.fit` without a strategy builds the optimizer in the first
        traced step, after the forward pass, but the forward pass must read
        the optimizer's counter; Keras builds it with the same variables.
        """
        model, optimizer = (None, None) if self._gradaccum_model is None else (
            self._gradaccum_model(), self._gradaccum_optimizer()
        )
        if model is None or optimizer is None:
            raise ValueError(
                "gradaccum.layers.BatchNormalization follows an optimizer that is "
                "not built yet. Build it before the first step: "
                "`optimizer.build(model.trainable_variables)`."
            )
        # Outside the layer's autocast scope, as Keras builds it: the
        # optimizer's slots copy the variables as they are (float32).
        with AutocastScope(None):
            optimizer.build(model.trainable_variables)

    def _count(self, inputs: Any, mask: Any) -> Any:
        """The micro-batch's sample count per channel: over all replicas
        where Keras's moments are (`synchronized=True` without a mask; with
        a mask Keras takes each replica's own)."""
        if mask is not None:
            return ops.sum(ops.cast(mask, "float32"))
        shape = ops.shape(inputs)  # a tensor for each size known only at run time
        count = 1
        for axis in self._reduction_axes:
            count = count * shape[axis]
        count = ops.cast(count, "float32")
        backend = _backend.for_active()
        if self.synchronized and backend.replicas.count() > 1:
            count = backend.replicas.sum(count)
        return count

    def _pool(self, mean: Any, variance: Any, count: Any, last: Any) -> None:
        mean = ops.cast(mean, "float32")
        variance = ops.cast(variance, "float32")
        n_a = self.pooled_count.value
        mean_a = self.pooled_mean.value
        m2_a = self.pooled_m2.value
        total = n_a + count
        # An empty micro-batch (a ragged end of 0 samples) adds nothing.
        share = ops.divide_no_nan(count, total)
        delta = mean - mean_a
        pooled_mean = mean_a + delta * share
        pooled_m2 = m2_a + variance * count + ops.square(delta) * n_a * share
        self._finish(total, pooled_mean, pooled_m2, last)

    def _finish(self, total: Any, mean: Any, m2: Any, last: Any) -> None:
        """On `last`, the moving update with the pool, which is then emptied;
        otherwise the pool is kept."""
        momentum = self.momentum
        moving_mean = keras.ops.cast(self.moving_mean, "float32")
        moving_variance = keras.ops.cast(self.moving_variance, "float32")
        pooled_variance = ops.divide_no_nan(m2, total)
        new_mean = moving_mean * momentum + mean * (1.0 - momentum)
        new_variance = moving_variance * momentum + pooled_variance * (1.0 - momentum)
        # A flush of an empty pool changes nothing.
        last = ops.logical_and(last, total > 0)
        self.moving_mean.assign(ops.where(last, new_mean, moving_mean))
        self.moving_variance.assign(ops.where(last, new_variance, moving_variance))
        self.pooled_count.assign(ops.where(last, ops.zeros_like(total), total))
        self.pooled_mean.assign(ops.where(last, ops.zeros_like(mean), mean))
        self.pooled_m2.assign(ops.where(last, ops.zeros_like(m2), m2))

    def flush(self) -> None:
        """Applies the pooled statistics of a partial cycle, if any."""
        if not self.built:
            return
        self._finish(
            self.pooled_count.value, self.pooled_mean.value, self.pooled_m2.value, ops.convert_to_tensor(True)
        )


# ----------------------------------------------------------------------
# Finding the cycle.


def _layers_of(model: Any) -> list[BatchNormalization]:
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return []
    return [layer for layer in flatten(include_self=False) if isinstance(layer, BatchNormalization)]


def follow(model: Any, optimizer: Any) -> None:
    """Points the model's `gradaccum.layers.BatchNormalization` layers at a cycle.

    `Model.compile` does this for the model's own optimizer; call it once in
    a custom loop whose model is not compiled with the accumulating
    optimizer that trains it.

    Args:
        model: A Keras model; its layers (nested ones included) that are
            `gradaccum.layers.BatchNormalization` follow `optimizer`.
        optimizer: The accumulating optimizer that trains `model` (or a
            loss-scale optimizer around one). An optimizer that does not
            accumulate detaches the layers: they act as Keras's layer.

    Raises:
        TypeError: If `model` is not a Keras model or `optimizer` not a
            Keras optimizer (the arguments swapped, say).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a Keras model (the first argument: `follow(model, optimizer)`). "
            f"Received: model={model!r} of type {type(model).__name__}."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a Keras optimizer, accumulating or not (the second argument: "
            f"`follow(model, optimizer)`). Received: optimizer={optimizer!r} of type {type(optimizer).__name__}."
        )
    _point(model, optimizer)


def _point(model: Any, optimizer: Any) -> None:
    """`follow` for the patches: any model, and any optimizer or None."""
    layers = _layers_of(model)
    if not layers:
        return
    core = _families.core_in(optimizer)
    for layer in layers:
        layer._gradaccum_cycle = None if core is None else weakref.ref(core)
        layer._gradaccum_model = weakref.ref(model)
        layer._gradaccum_optimizer = None if core is None else weakref.ref(optimizer)
        if core is not None:
            core.follow(layer)


def after_compile(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    if instance is not None:
        _point(instance, getattr(instance, "optimizer", None))
    return result


def before_train_function(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # `fit` may have been given another optimizer since `compile`
    # (`gradaccum.accumulating` wraps a compiled model's).
    if instance is not None:
        _point(instance, getattr(instance, "optimizer", None))
    return wrapped(*args, **kwargs)


# ----------------------------------------------------------------------
# Creating this layer where code asks for Keras's (`replacing`).

_local = threading.local()


@contextlib.contextmanager
def replacing() -> Iterator[None]:
    """Within the block (in this thread), `keras.layers.BatchNormalization(...)`
    creates this module's `BatchNormalization`, with the same arguments; so
    does deserializing one (`load_model`). Subclasses of Keras's layer are
    created as they are."""
    _patches.install("layers")
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def new(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `BatchNormalization.__new__`, creating this module's layer
    instead inside `replacing()`. Python then runs `__init__` of the class
    created: it is a subclass."""
    cls, *rest = args
    if cls is keras.layers.BatchNormalization and getattr(_local, "depth", 0):
        cls = BatchNormalization
    return wrapped(cls, *rest, **kwargs)


# Keras files name the class by its public module.
BatchNormalization.__module__ = "gradaccum.layers"
