"""The loop over a train step's micro-batches on TensorFlow.

In `model.fit`'s traced step the batch's size is usually unknown (None), so
the number of micro-batches is a tensor: a `tf.while_loop` runs Keras's
original train step once per full micro-batch of `size` samples (a slice
of static size, as XLA needs), and a `tf.cond` once more for a ragged last
micro-batch. The micro-steps in them only accumulate; the cycle's update
runs once, after them (`splitting(count, defer=True)`): under a
`tf.distribute` strategy of several replicas the optimizer's all-reduce and
writes (merge calls) cannot run inside a loop or a branch of one replica,
and each replica's share of a ragged batch may need fewer micro-batches
than another's. Every variable the step writes exists before the loop: the
optimizer and its accumulators are built by `fit` before it traces the
step, and kept `tf.IndexedSlices` are created when the step is traced (in
`tf.init_scope`). Under XLA their buffers hold the cycle the trace's batch
size allows (`kept.split_into`); where the trace does not know it, a
variable's slices are added into rows, with a warning that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from gradaccum._backend.tensorflow import kept


def _slice(data: Any, start: Any, size: Any) -> Any:
    def cut(t: Any) -> Any:
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        begin = tf.concat([tf.reshape(start, [1]), tf.zeros([tf.rank(t) - 1], tf.int32)], 0)
        extent = tf.concat([tf.reshape(size, [1]), tf.fill([tf.rank(t) - 1], -1)], 0)
        cut = tf.slice(t, begin, extent)
        if isinstance(size, int):
            cut = tf.ensure_shape(cut, [size] + t.shape.as_list()[1:])
        return cut

    return tree.map_structure(cut, data)


def _check_replicas(size: int, replicas: int, model: Any) -> None:
    if size % replicas:
        raise ValueError(
            f"micro_batch_size={size} counts the samples of one micro-batch over all {replicas} replicas "
            f"(as `batch_size` does), which each compute an equal share: it must be a multiple of {replicas}. "
            f"Received: micro_batch_size={size}."
        )
    _check_splittable(size, replicas, model, tf.executing_eagerly())


def _check_splittable(size: int | str, replicas: int, model: Any, eagerly: bool) -> None:
    if replicas == 1:
        return
    if eagerly:
        raise ValueError(
            f"micro_batch_size={size!r} under a tf.distribute strategy of {replicas} replicas runs in a "
            "`tf.function`: compile the model without `run_eagerly=True`, or accumulate across steps with "
            "accumulate(optimizer, n=k) and batches of B / k."
        )
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"micro_batch_size={size!r} under a tf.distribute strategy of {replicas} replicas cannot split the "
            "step of a LossScaleOptimizer, which synchronises the replicas on every micro-batch (a merge call "
            "TensorFlow refuses inside the step's loop). Accumulate across steps with "
            "accumulate(optimizer, n=k) and batches of B / k, or train without loss scaling."
        )


def check_auto(model: Any) -> None:
    """Raises where `micro_batch_size="auto"` cannot choose under `model`'s
    strategy: of several workers, which would each choose, and run again
    smaller, on their own, while the others wait in the step's collectives;
    or of several replicas that cannot split the step at all.

    Raises:
        ValueError: Naming the strategy's workers or replicas and what to
            pass instead.
    """
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return
    local = len(strategy.extended.worker_devices)
    if replicas > local:
        raise ValueError(
            f"micro_batch_size=\"auto\" chooses the micro-batch on each worker, and under a tf.distribute "
            f"strategy of {replicas} replicas over several workers ({local} on this one) they would have to agree on "
            f"one size before the step's first collective. Pass micro_batch_size=m (samples over all "
            f"replicas, a multiple of {replicas}) that fits each replica's device. "
            "Received: micro_batch_size=\"auto\"."
        )
    _check_splittable("auto", replicas, model, model.run_eagerly)


def replicas_batch_size(value: Any) -> Any:
    """The samples of a `tf.distribute` value's every local replica (None
    where a share's size is unknown)."""
    shares = [t.shape[0] for t in value.values]
    return None if None in shares else sum(shares)


def raising_after(logs: Any, message: str) -> Any:
    """`logs` (a micro-batch's), once the op that raises TensorFlow's
    out-of-memory error saying `message` ran after them (the test hook
    `out_of_memory_above`: Python's MemoryError in the op is TensorFlow's
    `ResourceExhaustedError`)."""

    def fail() -> Any:
        raise MemoryError(f"OOM: {message}")

    with tf.control_dependencies(tree.flatten(logs)):
        failed = tf.py_function(fail, [], tf.bool)
    with tf.control_dependencies([failed]):
        return tree.map_structure(tf.identity, logs)


def _metrics_result(model: Any, data: Any) -> Any:
    """The logs' structure before the first micro-batch: the model's
    metrics' results. Metrics given to `compile`, and a multi-output
    model's per-output loss trackers, are built by the first step that
    updates them; Keras builds them before tracing only under a strategy,
    so here they are built as Keras does then."""
    compiled = (getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None))
    if any(c is not None and not c.built for c in compiled):
        model._symbolic_build(data_batch=data)
    return model.get_metrics_result()


def _weighing_per_output_losses(step: Callable[[Any], Any], model: Any, total: Any) -> Callable[[Any], Any]:
    """`step`, whose micro-batch adds its share of the batch to a
    multi-output model's per-output loss trackers (in the logs).

    Keras weighs a batch's per-output losses by its static size, which a
    batch of unknown size (None) does not have: each batch weighs 1. A
    micro-batch's slice has a static size, so it would weigh its samples
    instead; the micro-batch of `m` samples of a batch of `total` weighs
    `m / total`, so that the batch weighs 1, as it does unsplit.
    """
    trackers = list(getattr(getattr(model, "_compile_loss", None), "metrics", None) or [])
    if not trackers:
        return step

    def run(micro_batch: Any) -> Any:
        before = [(tf.identity(t.total.value), tf.identity(t.count.value)) for t in trackers]
        logs = step(micro_batch)
        leaf = next(tf.convert_to_tensor(t) for t in tree.flatten(micro_batch) if t is not None)
        share = tf.cast(tf.shape(leaf)[0], tf.float32) / tf.cast(total, tf.float32)
        for tracker, (summed, counted) in zip(trackers, before):
            value = tf.math.divide_no_nan(tracker.total.value - summed, tracker.count.value - counted)
            tracker.total.assign(summed + tf.cast(share, summed.dtype) * value)
            tracker.count.assign(counted + tf.cast(share, counted.dtype))
        if isinstance(logs, dict):
            logs = dict(logs, **{t.name: t.result() for t in trackers if t.name in logs})
        return logs

    return run


def split(step: Callable[[Any], Any], data: Any, size: int, splitting: Callable[..., Any], model: Any) -> Any:
    """Keras's TensorFlow train step `step(data)`, once per micro-batch.

    Args:
        step: The original train step.
        data: The batch (this replica's share of it, under a strategy).
        size: Samples per micro-batch, over all replicas: each replica
            computes `size / replicas` of them.
        splitting: The context of one cycle of a given count of micro-batches
            whose update is deferred until the loop is done.
        model: The model the step trains.

    Returns:
        The logs of the last micro-batch.

    Raises:
        ValueError: Under a `tf.distribute` strategy of several replicas, if
            `size` is not a multiple of their number, if the step runs eagerly,
            or for a loss-scale optimizer (whose every micro-step makes merge calls).
    """
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    _check_replicas(size, replicas, model)
    size //= replicas
    leaf = next(tf.convert_to_tensor(t) for t in tree.flatten(data) if t is not None)
    total = tf.shape(leaf, out_type=tf.int32)[0]
    full = total // size
    rest = total - full * size
    count = full + tf.cast(rest > 0, tf.int32)
    known = leaf.shape[0]
    # A ragged last micro-batch of a static size where the batch's is: Keras
    # weighs a micro-batch's per-output losses in the logs by its static size.
    last_size = known % size if known is not None and known % size else rest
    with splitting(count, defer=True) as at, kept.split_into(None if known is None else -(-known // size)):
        start = (tf.constant(0), _metrics_result(model, data))
        if known is None:
            step = _weighing_per_output_losses(step, model, total)

        # XLA compiles the loop's body for the batch's run-time shape even
        # where it runs no full micro-batch (a ragged last batch smaller than
        # `size`): a slice larger than the batch does not compile.
        full_size = tf.minimum(size, total) if known is None else min(size, known)

        def body(i: Any, logs: Any) -> tuple[Any, Any]:
            at(i)
            logs = step(_slice(data, i * size, full_size))
            return i + 1, tree.map_structure(tf.convert_to_tensor, logs)

        # One micro-batch after the other: each reads the variables the last wrote.
        _, logs = tf.while_loop(lambda i, _: i < full, body, start, parallel_iterations=1)

        def last() -> Any:
            at(full)
            return tree.map_structure(tf.convert_to_tensor, step(_slice(data, full * size, last_size)))

        logs = tf.cond(rest > 0, last, lambda: logs)
    return logs


def step_bytes(step: Callable[[Any], Any], data: Any) -> int:
    """The bytes XLA's compiled TensorFlow train step `step(data)` uses: the
    allocations of its buffer assignment (arguments, outputs, temporaries;
    not those local to a thread), read from the `HloProto` that
    `experimental_get_compiler_ir` gives at stage
    `"optimized_hlo_proto_serialized"`: what JAX's `memory_analysis()` sums.
    One compilation; nothing runs."""
    from tensorflow.compiler.xla.service import hlo_pb2

    # Traced as Keras traces its train function: unconverted by AutoGraph.
    function = tf.function(tf.autograph.experimental.do_not_convert(step), jit_compile=True)
    serialized = function.experimental_get_compiler_ir(data)(stage="optimized_hlo_proto_serialized")
    allocations = hlo_pb2.HloProto.FromString(serialized).buffer_assignment.buffer_allocations
    return int(sum(a.size for a in allocations if not a.is_thread_local))
