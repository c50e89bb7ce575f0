"""Skip mode: the wrapped optimizer's update runs only on apply steps.

On an in-between micro-step nothing but the accumulators and the micro-step
counter changes, and none of the update's work is done. The decision is a
`tf.cond` on `keep_new`. A `tf.cond` in replica context must not enclose a
`merge_call`, and the wrapped optimizer's update makes several (all-reduce,
per-variable updates, the step counter), so under strategies that need
merge calls (`MirroredStrategy`) the decision is taken in cross-replica
context and the update re-enters replica context inside the branch, as
Keras's `LossScaleOptimizer` does:

    merge_call -> tf.cond(keep_new, call_for_each_replica(update), no-op)

Each replica computes the same `keep_new` (from the mirrored micro-step
counter), so every replica takes the same branch.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def _skipped_update(
    keep_new: tf.Tensor, update: Callable[..., Any], *args: Any
) -> None:
    """Runs `update(*args)` in replica context if `keep_new`, else nothing.

    Args:
        keep_new: Scalar boolean tensor (identical on every replica).
        update: Called in replica context; must capture no per-replica
            tensor (it may run in another replica's thread). Per-replica
            inputs go in `args`.
        *args: Per-replica inputs of `update` (tensors or lists of them).
    """
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "Gradients must be applied in replica context (inside "
            "`strategy.run` or `model.fit`), not in cross-replica context."
        )

    def run() -> None:
        update(*args)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(keep_new, run, _nothing)
        return

    def decide(distribution: tf.distribute.Strategy, keep_new: Any, *args: Any) -> None:
        # Every replica computed the same value; take the first replica's.
        keep = distribution.experimental_local_results(keep_new)[0]

        def run_on_each_replica() -> None:
            distribution.extended.call_for_each_replica(update, args=args)

        tf.cond(keep, run_on_each_replica, _nothing)

    tf.distribute.get_replica_context().merge_call(decide, args=(keep_new, *args))


def _nothing() -> None:
    return None
