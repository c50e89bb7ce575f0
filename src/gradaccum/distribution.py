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
from typing import Any, Callable, Iterator

import tensorflow as tf


def _tf_variable(variable: Any) -> tf.Variable:
    """The TensorFlow variable behind a Keras 3 variable (or itself)."""
    value = getattr(variable, "value", None)
    if isinstance(value, tf.Variable):
        return value
    return variable


@contextlib.contextmanager
def _creation_scope(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Creates variables eagerly, under `strategy` unless one is active."""
    with tf.init_scope():
        if tf.distribute.has_strategy() or strategy is None:
            yield
        else:
            with strategy.scope():
                yield


def _replica_local(initial: tf.Tensor, name: str, colocate_with=None) -> tf.Variable:
    """A variable each replica updates on its own; reads sum over replicas."""
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
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )


def _mirrored_counter(initial: int, name: str, dtype=tf.int64) -> tf.Variable:
    """A scalar every replica holds and advances identically."""
    return tf.Variable(
        tf.constant(initial, dtype=dtype),
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _in_cross_replica(
    strategy: tf.distribute.Strategy, fn: Callable[..., Any], *args: Any
) -> Any:
    """Runs `fn(strategy, *args)` in cross-replica context.

    From replica context this is a `merge_call`; per-replica tensors in
    `args` arrive as `PerReplica` values that `strategy.extended.update`
    unwraps device by device.
    """
    return tf.__internal__.distribute.interim.maybe_merge_call(
        fn, strategy, *args
    )


def _assign_each(
    strategy: tf.distribute.Strategy,
    variables: list[tf.Variable],
    fn: Callable[..., Any],
    *per_variable_args: list[Any],
) -> None:
    """In cross-replica context: `fn(var, *args)` on every copy of every var."""
    for var, *args in zip(variables, *per_variable_args):
        strategy.extended.update(var, fn, args=tuple(args), group=False)
