"""tf.distribute plumbing: where state lives and where decisions are taken.

The accumulators are replica-local (`ON_READ`, summed when read across
replicas), so each replica adds its own micro-gradients without any
communication. Counters that every replica advances identically are mirrored
with `ONLY_FIRST_REPLICA` aggregation. Writes to mirrored state happen in
cross-replica context (`merge_call`), never inside a `tf.cond`, so the same
code runs under the default strategy, `MirroredStrategy` and
`MultiWorkerMirroredStrategy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def tf_variable(variable: Any) -> tf.Variable:
    """The TensorFlow variable behind a Keras 3 variable (or itself)."""
    value = getattr(variable, "value", None)
    if isinstance(value, tf.Variable):
        return value
    return variable


def strategy_of(optimizer: Any) -> tf.distribute.Strategy:
    """The strategy an optimizer was created under (else the current one)."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return strategy if strategy is not None else tf.distribute.get_strategy()


@contextlib.contextmanager
def creation_scope(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Creates variables eagerly, under `strategy` unless one is active."""
    with tf.init_scope():
        if tf.distribute.has_strategy() or strategy is None:
            yield
        else:
            with strategy.scope():
                yield


def replica_local(
    initial: tf.Tensor, name: str, colocate_with: Any = None, shape: Any = None
) -> tf.Variable:
    """A variable each replica updates on its own; reads sum over replicas.

    `shape`, if given, may leave dimensions unknown: the variable then
    takes values of any compatible shape.
    """
    strategy = tf.distribute.get_strategy()
    ctx = (
        strategy.extended.colocate_vars_with(colocate_with)
        if colocate_with is not None
        else contextlib.nullcontext()
    )
    with ctx:
        return tf.Variable(
            initial,
            name=name,
            shape=shape,
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )


def local_copy(variable: tf.Variable) -> tf.Variable:
    """This replica's own copy of a replica-local variable (else `variable`).

    Replica-local (`ON_READ`) variables refuse scatter updates; the copy on
    the current replica's device takes them.
    """
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable._get_on_device_or_primary()
    return variable


def copies(variable: tf.Variable) -> list[tf.Variable]:
    """Every replica's copy of a distributed variable (else `[variable]`).

    For eager writes that differ per replica, which a replica-local
    variable's own `assign` (splitting one value among the replicas) cannot
    make.
    """
    if isinstance(variable, tf.distribute.DistributedValues):
        return list(variable.values)
    return [variable]


def mirrored_counter(initial: Any, name: str, dtype: tf.DType = tf.int64) -> tf.Variable:
    """A value (a scalar, or a tensor of its own dtype) every replica holds
    and advances identically."""
    return tf.Variable(
        initial if tf.is_tensor(initial) else tf.constant(initial, dtype=dtype),
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def in_cross_replica(strategy: tf.distribute.Strategy, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs `fn(strategy, *args)` in cross-replica context.

    From replica context this is a `merge_call`; per-replica tensors in
    `args` arrive as `PerReplica` values that `strategy.extended.update`
    unwraps device by device.
    """
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def in_replica_context() -> bool:
    """Whether a strategy is active and this code runs per replica."""
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def run_per_replica(strategy: tf.distribute.Strategy, fn: Callable[[], Any]) -> None:
    """Runs `fn` on every replica of `strategy` (from cross-replica context)."""
    with strategy.scope():
        strategy.run(fn)


def check_strategy(owner: tf.distribute.Strategy, what: str) -> None:
    """Raises if a strategy scope other than `owner`'s is active.

    Keras creates an optimizer's step counter when the optimizer is created
    and its slots under the strategy it was created in, so an optimizer made
    outside `strategy.scope()` cannot be built for variables made inside it.
    """
    if not tf.distribute.has_strategy():
        return
    active = tf.distribute.get_strategy()
    if owner is None or active is owner:
        return
    if type(owner).__name__ == "_DefaultDistributionStrategy":
        created = "outside any `tf.distribute` strategy scope"
    else:
        created = f"under another {type(owner).__name__}"
    raise ValueError(
        f"`{what}` was created {created} but is used under "
        f"{type(active).__name__}. Create the optimizer inside the "
        "`strategy.scope()` that creates the model (wrapping it with "
        "`accumulate()` may happen inside or outside that scope)."
    )


def check_buildable(what: str) -> None:
    """Raises if variables cannot be created here: replica context in a graph.

    Keras optimizers cannot create their slots inside `strategy.run` within a
    `tf.function` when there are several replicas (the variable initialisers
    end up in the function's graph); it fails later with an unrelated-looking
    graph error.
    """
    if in_replica_context() and not tf.executing_eagerly() and replicas_in_sync() > 1:
        raise ValueError(
            f"`{what}` is not built yet and cannot be built inside "
            "`strategy.run` in a `tf.function`. Build it before the training "
            "loop: call `optimizer.build(model.trainable_variables)` inside "
            "`strategy.scope()`."
        )


def replicas_in_sync() -> int:
    """Replicas taking part in the current replica context (1 outside one)."""
    context = tf.distribute.get_replica_context()
    return context.num_replicas_in_sync if context is not None else 1


def replica_id() -> int:
    """This replica's index in its sync group (0 outside replica context).

    Under `MirroredStrategy` each replica runs its step in its own thread,
    and a call that crosses replica context (a loss-scale optimizer's
    `merge_call`) comes back on new threads; the index is what stays the
    same for one replica throughout a step.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0
    value = tf.get_static_value(context.replica_id_in_sync_group)
    return 0 if value is None else int(value)


def sum_over_replicas(values: Any) -> Any:
    """All-reduces `values` (dense tensors) by summation across replicas."""
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, values)


def per_replica_share(total: np.ndarray) -> np.ndarray:
    """The value each replica holds so that replica-local reads sum to total."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return total / replicas if replicas > 1 else total


def clip_as_one_device(grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """Clips the gradient summed over replicas, as one device would.

    Keras 3 clips each replica's share of the gradient before its
    all-reduce, so with several replicas it clips a different vector than
    training on one device does. Summing first, clipping with the
    optimizer's own rule `clip`, and handing each replica `1 / replicas` of
    the result makes the optimizer's all-reduce rebuild the clipped sum; its
    own clipping then leaves the (already small enough) shares alone. Costs
    one more all-reduce per step.
    """
    replicas = replicas_in_sync()
    # `None` gradients (possible with `n=1`, where gradients come as they
    # are) take no part in the all-reduce and stay `None`.
    present = [k for k, g in enumerate(grads) if g is not None]
    summed = list(grads)
    for k, g in zip(present, sum_over_replicas([grads[k] for k in present])):
        summed[k] = g
    return [_divided(g, replicas) for g in clip(summed)]


def _divided(grad: Any, replicas: int) -> Any:
    """A replica's share of a summed gradient. The all-reduce concatenates
    `tf.IndexedSlices`, so for them the first replica hands over all the
    slices and every other replica none: a share of each slice on every
    replica would repeat it, and optimizers that square slices would see
    `1 / replicas` of their squares."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        if replica_id() == 0:
            return grad
        return tf.IndexedSlices(grad.values[:0], grad.indices[:0], grad.dense_shape)
    return grad / replicas


def assign_each(
    strategy: tf.distribute.Strategy,
    variables: Sequence[tf.Variable],
    fn: Callable[..., Any],
    *per_variable_args: Sequence[Any],
) -> None:
    """In cross-replica context: `fn(var, *args)` on every copy of every var."""
    for var, *args in zip(variables, *per_variable_args):
        strategy.extended.update(var, fn, args=tuple(args), group=False)

