"""Training under `tf.distribute` (TensorFlow only), for tests and workers.

`custom_loop` trains with `strategy.run` inside a `tf.function`, the way
custom training code does; under the default strategy it is the plain
single-device loop, so the same code gives the large-batch reference.
`replica_states` reads every copy of every model and optimizer variable, so
tests can check that replicas agree and that in-between micro-steps change
nothing on any replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tests.helpers.state import assert_states_equal, named_variables

_MIRRORED: list[tf.distribute.MirroredStrategy] = []


def mirrored() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy over the two logical CPUs (tests/conftest.py), shared by all tests.

    Several MirroredStrategy objects in one process hand out the same
    collective instance keys, so their all-reduces can meet each other.
    """
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


def distributed_batches(
    strategy: tf.distribute.Strategy, x: np.ndarray, y: np.ndarray, global_batch: int
) -> Any:
    """Global batches of `global_batch` in order, cut into per-replica slices.

    Replica `r` (numbered across all workers) gets rows
    `[r * per_replica, (r + 1) * per_replica)` of every global batch, so the
    samples in each global batch are exactly those of the single-device
    batch, whatever the number of workers.
    """
    replicas = strategy.num_replicas_in_sync
    if global_batch % replicas:
        raise ValueError(f"global_batch={global_batch} not divisible by {replicas}")
    per_replica = global_batch // replicas

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        local = context.num_replicas_in_sync // context.num_input_pipelines
        first = context.input_pipeline_id * local

        def split(xb, yb):
            xb = tf.reshape(xb, (replicas, per_replica) + tuple(x.shape[1:]))
            yb = tf.reshape(yb, (replicas, per_replica) + tuple(y.shape[1:]))
            return tf.data.Dataset.from_tensor_slices(
                (xb[first : first + local], yb[first : first + local])
            )

        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        return dataset.batch(global_batch, drop_remainder=True).flat_map(split)

    return strategy.distribute_datasets_from_function(dataset_fn)


def custom_loop(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    optimizer: Any,
    x: np.ndarray,
    y: np.ndarray,
    global_batch: int,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Trains one epoch: `strategy.run(step)` inside one `tf.function`.

    The loss is the mean squared error over the global batch
    (`tf.nn.compute_average_loss`), so the summed replica gradients are the
    gradient of the single-device loss on the same samples.
    """
    loss_fn = keras.losses.MeanSquaredError(reduction=None)
    with strategy.scope():
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    for step, (xb, yb) in enumerate(distributed_batches(strategy, x, y, global_batch)):
        train_step(xb, yb)
        if on_step is not None:
            on_step(step)


def _local(strategy: tf.distribute.Strategy, variable: Any) -> list[np.ndarray]:
    # Keras variables wrap a TF (distributed) variable in `.value`.
    tf_variable = variable if isinstance(variable, tf.Variable) else variable.value
    local = strategy.experimental_local_results(tf_variable)
    return [np.asarray(t.numpy()) for t in local]


def replica_states(
    strategy: tf.distribute.Strategy, model: keras.Model, optimizer: Any
) -> list[dict[str, np.ndarray]]:
    """`state.full_state` for each local replica's copy of the variables."""
    named = named_variables(model, optimizer) + [("iterations", optimizer.iterations)]
    states: list[dict[str, np.ndarray]] = [
        {} for _ in range(len(strategy.extended.worker_devices))
    ]
    for key, variable in named:
        for state, value in zip(states, _local(strategy, variable)):
            state[key] = value
    return states


def replica_accumulators(
    strategy: tf.distribute.Strategy, optimizer: Any
) -> list[list[np.ndarray]]:
    """Each local replica's own accumulator values (they are replica-local)."""
    accumulators = optimizer.accumulation_state.accumulators
    per_variable = [_local(strategy, a) for a in accumulators]
    return [list(values) for values in zip(*per_variable)]


class RecordStates(keras.callbacks.Callback):
    """Records `replica_states` and accumulators after every batch of fit.

    `core` is the `AccumulatingOptimizer` holding the accumulators when
    `optimizer` is a loss-scale optimizer around it (default: `optimizer`).
    """

    def __init__(
        self, strategy: tf.distribute.Strategy, optimizer: Any, core: Any = None
    ):
        super().__init__()
        self.strategy = strategy
        self.optimizer = optimizer
        self.core = core if core is not None else optimizer
        self.states: list[list[dict[str, np.ndarray]]] = []
        self.accumulators: list[list[list[np.ndarray]]] = []

    def record(self) -> None:
        self.states.append(replica_states(self.strategy, self.model, self.optimizer))
        self.accumulators.append(replica_accumulators(self.strategy, self.core))

    def on_train_begin(self, logs=None):
        self.record()

    def on_train_batch_end(self, batch, logs=None):
        self.record()


def check_micro_steps(
    states: list[list[dict[str, np.ndarray]]],
    accumulators: list[list[list[np.ndarray]]],
    n: int,
) -> None:
    """Checks per-replica snapshots: `states[0]` before training, then one per
    micro-step.

    After every micro-step all replicas hold bit-identical variables; an
    in-between micro-step changes nothing on any replica (bit for bit); after
    every apply step each replica's accumulators are zero, and in between
    they hold that replica's own partial sums.
    """
    assert len(states) > n, "too few micro-steps recorded"
    for t in range(1, len(states)):
        first, *others = states[t]
        for other in others:
            assert_states_equal(first, other)
        if t % n:
            for before, after in zip(states[t - 1], states[t]):
                assert_states_equal(before, after)
            assert any(np.any(a != 0) for a in accumulators[t][0]), t
            for acc in accumulators[t][1:]:
                assert not all(
                    np.array_equal(a, b) for a, b in zip(accumulators[t][0], acc)
                ), f"micro-step {t}: replicas accumulated identical sums"
        else:
            for acc in accumulators[t]:
                assert all(not np.any(a) for a in acc), t
