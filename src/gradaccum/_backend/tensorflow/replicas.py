"""The hooks of `gradaccum._backend.Replicas` under `tf.distribute`
(`distribution`): the replicas, and what Keras 3's optimizer family asks of
them: the strategy an optimizer belongs to, whether it can be built here,
the `tf.Variable` behind a Keras variable, and its update with its writes
masked (`updates.split_apply`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gradaccum._backend.tensorflow import distribution, updates
from gradaccum._backend.tensors import OneReplica


class TensorFlowReplicas(OneReplica):
    """The hooks of `gradaccum._backend.Replicas` under `tf.distribute`."""

    def count(self) -> int:
        return distribution.replicas_in_sync()

    def index(self) -> int:
        return distribution.replica_id()

    def sum(self, values: Any) -> Any:
        return distribution.sum_over_replicas(values)

    def clip_as_one_device(self, grads: list[Any], clip: Callable[[list[Any]], list[Any]]) -> list[Any]:
        return distribution.clip_as_one_device(grads, clip)

    def on_each(self, family: Any, fn: Callable[[], None]) -> None:
        strategy = family.strategy()
        if strategy.num_replicas_in_sync > 1 and not distribution.in_replica_context():
            distribution.run_per_replica(strategy, fn)
        else:
            fn()

    def strategy_of(self, optimizer: Any) -> Any:
        return distribution.strategy_of(optimizer)

    def check_buildable(self, family: Any) -> None:
        # Keras builds an optimizer's slots under the strategy it was
        # created in, and cannot create them traced on one of several replicas.
        distribution.check_strategy(family.strategy(), "optimizer")
        distribution.check_buildable("optimizer")

    def native(self, variable: Any) -> Any:
        return distribution.tf_variable(variable)

    def apply_masked(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], masking: Any) -> None:
        updates.split_apply(optimizer, list(grads), list(variables), masking)
