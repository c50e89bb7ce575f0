"""The optimizer proxy: `accumulate()` and `AccumulatingOptimizer`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf
import wrapt

from gradaccum._validation import _check_n, _check_reduction
from gradaccum.adapters import _adapter_for, _families
from gradaccum.distribution import _creation_scope, _mirrored_counter, _replica_local
from gradaccum.loss_scaling import _inner_attribute, _install
from gradaccum.masking import _masked_update
from gradaccum.serialization import (
    _AccumulationState,
    _Saveable,
    _install_keras_serialization,
)


def _accumulator_dtype(variable: Any) -> tf.DType:
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def _check_optimizer(optimizer: Any) -> Any:
    """Returns the adapter for `optimizer`, or raises if it cannot be wrapped."""
    if isinstance(optimizer, AccumulatingOptimizer):
        raise ValueError(
            "`optimizer` is already an AccumulatingOptimizer "
            f"(n={optimizer.n}); wrapping it again would accumulate twice. "
            "Pass the plain optimizer, or set the number of micro-batches "
            "on the existing wrapper."
        )
    adapter = _adapter_for(optimizer)
    if adapter is None:
        hint = ""
        if isinstance(optimizer, (int, type)) or callable(optimizer):
            hint = (
                " To decorate an optimizer class or factory, call "
                "`accumulate(n=...)` with `n` as a keyword."
            )
        raise TypeError(
            f"`optimizer` must be an optimizer instance ({_families()}). "
            f"Received: {optimizer!r} of type {type(optimizer).__name__}.{hint}"
        )
    attribute = _inner_attribute(optimizer)
    if attribute is not None and isinstance(
        getattr(optimizer, attribute), AccumulatingOptimizer
    ):
        raise ValueError(
            "`optimizer` is a loss-scale optimizer around an "
            "AccumulatingOptimizer already; wrapping it would accumulate twice."
        )
    adapter.check()
    return adapter


class AccumulatingOptimizer(_Saveable, wrapt.ObjectProxy):
    """A Keras optimizer that applies one update every `n` micro-batches.

    The proxy is the wrapped optimizer to everyone else: `isinstance`,
    `learning_rate`, `iterations`, `variables`, `get_config()` and `build()`
    reach the wrapped instance. Each call of `apply_gradients()` (or
    `apply()`) adds the gradients to float32 accumulators; on every `n`-th
    call the wrapped optimizer applies their mean (or sum) once, so clipping,
    weight decay, EMA, constraints, learning-rate schedules and `iterations`
    see exactly what training on the `n`-times larger batch sees.

    The update is branch-free: every call runs the wrapped optimizer's update
    and keeps its result only on the apply step (see `gradaccum.masking`).

    Wrapping a loss-scale optimizer accumulates inside it, on its inner
    optimizer: the result is still the loss-scale optimizer to other code,
    and a non-finite micro-batch is dropped, not counted (see
    `gradaccum.loss_scaling`).

    Create it with `gradaccum.accumulate()`.

    Args:
        optimizer: The Keras optimizer instance to wrap.
        n: Number of micro-batches per update, an int >= 1.
        reduction: `"mean"` applies the mean of the `n` micro-gradients (for
            mean-reduced losses), `"sum"` applies their sum.

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer or `n` is not an
            int.
        ValueError: If `n < 1`, `reduction` is unknown, or `optimizer`
            already accumulates gradients.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        n: int,
        reduction: str = "mean",
        *,
        _adopt: bool = False,
    ):
        attribute = _inner_attribute(optimizer)
        adopted = None
        if _adopt and attribute is not None:
            # Deserializing: the loss-scale optimizer's inner optimizer was
            # saved as the accumulating one.
            adopted = getattr(optimizer, attribute)
            if not isinstance(adopted, AccumulatingOptimizer):
                adopted = None
        adapter = _adapter_for(optimizer) if adopted is not None else _check_optimizer(optimizer)
        n = _check_n(n)
        reduction = _check_reduction(reduction)
        super().__init__(optimizer)
        self._self_adapter = adapter
        self._self_n = n
        self._self_reduction = reduction
        # Where the accumulation happens: this proxy, or for a loss-scale
        # optimizer an AccumulatingOptimizer installed as its inner optimizer.
        self._self_core: AccumulatingOptimizer = self
        if adopted is not None:
            self._self_core = adopted
            return
        if attribute is not None:
            self._self_core = _install(
                optimizer,
                attribute,
                lambda inner: AccumulatingOptimizer(inner, n, reduction=reduction),
            )
            return
        self._self_state: _AccumulationState | None = None
        self._self_variables: list[Any] = []
        self._self_index: dict[Any, int] = {}
        # Indices of variables that have received a gradient: they take part
        # in every update from then on (zeros on micro-steps without one).
        self._self_seen: set[int] = set()
        if adapter.built:
            self._build_state(adapter.trainable_variables())

    # ------------------------------------------------------------------
    # Own read-only properties.

    @property
    def n(self) -> int:
        """Number of micro-batches accumulated per applied update."""
        return self._self_core._self_n

    @property
    def reduction(self) -> str:
        """`"mean"` or `"sum"`: how the `n` micro-gradients are combined."""
        return self._self_core._self_reduction

    @property
    def micro_step(self) -> tf.Tensor:
        """Micro-batches accumulated in the current cycle (int64, 0..n-1)."""
        state = self._self_core._self_state
        if state is None:
            return tf.constant(0, dtype=tf.int64)
        return tf.identity(state.micro_step)

    @property
    def built(self) -> bool:
        if self._self_core is not self:
            return bool(self.__wrapped__.built)
        return self._self_adapter.built and self._self_state is not None

    @built.setter
    def built(self, value: bool) -> None:
        self.__wrapped__.built = value

    # ------------------------------------------------------------------
    # Building.

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer (if needed) and the accumulators.

        Args:
            variables: The trainable variables the optimizer will update.
        """
        if self._self_core is not self:
            self.__wrapped__.build(list(variables))
            return
        adapter = self._self_adapter
        if not adapter.built:
            adapter.build(variables)
        if self._self_state is None:
            self._build_state(adapter.trainable_variables())

    def _build_state(self, variables: list[Any]) -> None:
        adapter = self._self_adapter
        with _creation_scope(adapter.strategy()):
            accumulators = [
                _replica_local(
                    tf.zeros(v.shape, dtype=_accumulator_dtype(v)),
                    name="accumulator",
                    colocate_with=adapter.model_variable(v),
                )
                for v in variables
            ]
            micro_step = _mirrored_counter(0, name="micro_step")
        self._self_variables = variables
        self._self_index = {adapter.var_key(v): i for i, v in enumerate(variables)}
        self._self_state = _AccumulationState(
            accumulators, micro_step, self._self_n, self._self_reduction
        )
        self._restore_deferred_state()

    def _indices_of(self, variables: Sequence[Any]) -> list[int]:
        var_key = self._self_adapter.var_key
        indices = []
        for v in variables:
            i = self._self_index.get(var_key(v))
            if i is None:
                name = getattr(v, "path", None) or getattr(v, "name", repr(v))
                raise ValueError(
                    f"Received a gradient for variable {name!r}, which this "
                    "optimizer was not built for. It was built for "
                    f"{len(self._self_variables)} variables: "
                    f"{[getattr(u, 'path', u.name) for u in self._self_variables]}."
                    " Build a new optimizer for a new set of variables."
                )
            indices.append(i)
        return indices

    # ------------------------------------------------------------------
    # Applying.

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        Args:
            grads_and_vars: `(gradient, variable)` pairs. A gradient may be
                `None` (counted as zeros) or a `tf.IndexedSlices`.

        Returns:
            The wrapped optimizer's `iterations` (applied updates).
        """
        if self._self_core is not self:
            return self.__wrapped__.apply_gradients(grads_and_vars)
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs)
            self.apply(grads, variables)
        return self._self_adapter.iterations

    def apply(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
    ) -> None:
        """Accumulates one micro-batch of gradients; applies every `n`-th.

        Args:
            grads: One gradient per variable (`None` counts as zeros).
            trainable_variables: The variables, in the order of `grads`; if
                omitted, those the optimizer was built with.

        Raises:
            ValueError: If a variable is not one the optimizer was built for,
                if `grads` does not match the built variables, or if every
                gradient is `None`.
        """
        if self._self_core is not self:
            return self.__wrapped__.apply(grads, trainable_variables)
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When `trainable_variables` is omitted the optimizer must "
                    "already be built: call `optimizer.build(variables)` first."
                )
            if len(grads) != len(self._self_variables):
                raise ValueError(
                    f"Received {len(grads)} gradients for an optimizer built "
                    f"for {len(self._self_variables)} variables."
                )
            trainable_variables = self._self_variables
        else:
            trainable_variables = list(trainable_variables)
            if len(grads) != len(trainable_variables):
                raise ValueError(
                    f"Received {len(grads)} gradients for "
                    f"{len(trainable_variables)} variables."
                )
        if not grads:
            return
        if not self.built:
            self.build(trainable_variables)
        indices = self._indices_of(trainable_variables)
        if all(g is None for g in grads):
            raise ValueError(
                "No gradients provided for any variable (every gradient is "
                "None)."
            )
        if self._self_n == 1:
            # Every micro-batch is a whole batch: hand the gradients over as
            # they are. Accumulating first would densify `IndexedSlices` and
            # sum repeated rows before the optimizer sees them, which Keras
            # does not do (it applies repeated rows one by one), and would
            # give previously seen variables zeros instead of skipping them.
            self._self_adapter.apply(grads, trainable_variables)
            return
        self._accumulate_and_apply(grads, indices)

    def _accumulate_and_apply(self, grads: list[Any], indices: list[int]) -> None:
        adapter = self._self_adapter
        state = self._self_state
        for g, i in zip(grads, indices):
            if g is None:
                continue
            acc = state.accumulators[i]
            if isinstance(g, tf.IndexedSlices):
                acc.scatter_add(
                    tf.IndexedSlices(
                        tf.cast(g.values, acc.dtype), g.indices, g.dense_shape
                    )
                )
            else:
                acc.assign_add(tf.cast(g, acc.dtype))
            self._self_seen.add(i)

        step = state.micro_step.read_value() + 1
        keep_new = step >= self._self_n
        included = sorted(self._self_seen)
        accumulated = [state.accumulators[i].read_value() for i in included]
        variables = [self._self_variables[i] for i in included]
        denominator = self._self_n if self._self_reduction == "mean" else 1
        update_grads = [
            tf.cast(a / denominator, tf.as_dtype(v.dtype))
            for a, v in zip(accumulated, variables)
        ]
        tracked = adapter.state_variables()
        # Every variable the optimizer was built for, not only those in this
        # update: with `ema_overwrite_frequency` Keras overwrites all of them
        # with their moving averages, gradient or not.
        tracked += [adapter.model_variable(v) for v in self._self_variables]
        _masked_update(
            adapter.strategy(),
            keep_new,
            tracked,
            lambda: adapter.apply(update_grads, variables),
        )
        for i, a in zip(included, accumulated):
            state.accumulators[i].assign(tf.where(keep_new, tf.zeros_like(a), a))
        state.micro_step.assign(tf.where(keep_new, tf.zeros_like(step), step))

    def __repr__(self) -> str:
        position = "?"
        if tf.executing_eagerly():
            position = str(int(self.micro_step.numpy()))
        return (
            f"<AccumulatingOptimizer n={self.n} "
            f"reduction={self.reduction!r} micro_step={position} "
            f"wrapping {self.__wrapped__!r}>"
        )


def accumulate(
    optimizer: keras.optimizers.Optimizer | None = None,
    n: int | None = None,
    *,
    reduction: str = "mean",
) -> AccumulatingOptimizer | Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives an optimizer gradient accumulation over `n` micro-batches.

    ```python
    opt = accumulate(keras.optimizers.Adam(1e-3), n=4)
    AccAdam = accumulate(n=4)(keras.optimizers.Adam)   # decorator form
    ```

    Args:
        optimizer: A Keras optimizer instance. Omit it to get a decorator for
            an optimizer class or factory function.
        n: Number of micro-batches per applied update, an int >= 1.
        reduction: `"mean"` (default) applies the mean of the micro-batch
            gradients, as training on the large batch with a mean-reduced loss
            does; `"sum"` applies their sum (for sum-reduced losses).

    Returns:
        An `AccumulatingOptimizer` around the very `optimizer` passed in, or,
        without `optimizer`, a decorator whose result builds one per call.

    Raises:
        TypeError: If `n` is missing or not an int, or `optimizer` is not a
            Keras optimizer.
        ValueError: If `n < 1`, `reduction` is unknown, or `optimizer`
            already accumulates gradients.
    """
    if n is None:
        raise TypeError(
            "accumulate() requires `n`, the number of micro-batches per update."
        )
    n = _check_n(n)
    reduction = _check_reduction(reduction)
    if optimizer is not None:
        return AccumulatingOptimizer(optimizer, n, reduction=reduction)

    def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(factory):
            raise TypeError(
                "accumulate(n=...) decorates an optimizer class or factory "
                f"function. Received: {factory!r} of type "
                f"{type(factory).__name__}."
            )

        @functools.wraps(factory, updated=())
        def make(*args: Any, **kwargs: Any) -> AccumulatingOptimizer:
            return AccumulatingOptimizer(
                factory(*args, **kwargs), n, reduction=reduction
            )

        return make

    return decorator


_install_keras_serialization(AccumulatingOptimizer)
