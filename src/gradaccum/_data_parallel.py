"""One gradient all-reduce per cycle in `fit` on JAX under `keras.distribution`.

Keras's JAX train step computes the gradients of the whole (batch-sharded)
micro-batch, so XLA all-reduces them on every micro-step, and the
accumulators receive their sum. When the accumulators are device-local
(`gradaccum._backend.device_local`), Keras's `JAXTrainer.train_step` is
wrapped (see `gradaccum._patches`) to compute them per device instead, where
the step is compiled (`jit_compile=True`, JAX's default):

1. Keras's own loss-and-gradient function runs inside `jax.shard_map` over
   the batch axis, each device on its share of the micro-batch, and records
   what its loss was divided by (`gradaccum._loss_counts`): its count.
2. The gradients leave it with a leading axis of one entry per device,
   sharded over that axis, and reach the optimizer as they are, each
   device's weighted by its count (`Weights.per_device_next`): each device
   adds `count * gradient` into its own entry, with no communication. The
   update, on the step that ends the cycle, sums the entries (the cycle's one
   all-reduce of the gradients) and divides by the weight total, which sums
   the counts: the gradient of the mean over every entry of the cycle.
3. The loss of the logs is the counts' weighted mean of the devices' losses;
   the metrics see the predictions, put together over the devices.

A step whose result per device would differ from the whole micro-batch's
runs as Keras runs it (one all-reduce per micro-step), with a warning once
per model naming why: a forward pass that changes non-trainable or metric
variables (BatchNormalization statistics, dropout's seeds), a loss whose
count does not make the devices' weighted mean the micro-batch's (a
`"sum"` reduction, several losses with masks), data not split evenly.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

from gradaccum import _families, _loss_counts


class _NotLocal(Exception):
    """Why a train step cannot compute its gradients per device."""


def train_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `JAXTrainer.train_step(state, data)`, with per-device gradients
    where the model's accumulating optimizer has device-local accumulators."""
    plan = _plan(instance)
    if plan is None or not _compiled(args, kwargs):
        return wrapped(*args, **kwargs)
    try:
        return _local_step(instance, *plan, *args, **kwargs)
    except _NotLocal as error:
        _warn(instance, str(error))
        return wrapped(*args, **kwargs)


def _compiled(args: tuple, kwargs: dict) -> bool:
    """Whether the step is traced by `jax.jit` (`jit_compile=True`). Run
    eagerly, JAX would compile the per-device function anew on every step,
    and an eager step's communication is not one program's to plan: such a
    step runs as Keras runs it."""
    import jax

    state = args[0] if args else kwargs.get("state")
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(state)[:1])


def _plan(model: Any) -> tuple[Any, Any] | None:
    """`(core, axis)` for a step with per-device gradients, or None."""
    core = _families.core_in(getattr(model, "optimizer", None))
    if core is None or core.state is None or core.cycle.hands_over():
        return None
    axis, why = core.backend.replicas.local_axis()
    if axis is None:
        if why is not None:
            _warn(model, why)
        return None
    return core, axis


def _local_step(model: Any, core: Any, axis: Any, state: Any, data: Any) -> Any:
    import jax
    from jax.sharding import PartitionSpec
    from keras.src.trainers.data_adapters import data_adapter_utils

    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    for leaf in jax.tree_util.tree_leaves((x, y, sample_weight)):
        if not leaf.shape or leaf.shape[0] % axis.size:
            raise _NotLocal(f"the data's batch axis ({leaf.shape}) does not split evenly over {axis.size} devices")
    optimizer = model.optimizer
    variables = list(optimizer.variables)
    local = [core.backend.replicas.local_devices(v) > 0 for v in variables]
    shared = [value for value, is_local in zip(optimizer_values, local) if not is_local]

    def per_device(trainable: Any, non_trainable: Any, metrics: Any, shared: Any, x: Any, y: Any, sw: Any) -> Any:
        # The loss (its scaling) reads no accumulator: zeros of their global
        # shape stand for them, which XLA removes.
        given = iter(shared)
        everything = [
            jax.numpy.zeros(v.shape, v.dtype) if is_local else next(given) for v, is_local in zip(variables, local)
        ]
        # Marked device-varying: the gradient of a value every device holds
        # alike (invariant) is all-reduced, that of a varying one is not.
        trainable = jax.lax.pcast(trainable, axis.name, to="varying")
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        with _loss_counts.recorded() as recording:
            (_, aux), grads = grad_fn(
                trainable, non_trainable, metrics, x, y, sw, training=True, optimizer_variables=everything
            )
        unscaled, y_pred, new_non_trainable, new_metrics = aux
        if any(a is not b for a, b in zip(new_non_trainable, non_trainable)):
            raise _NotLocal("the forward pass changes non-trainable variables (BatchNormalization statistics, "
                            "random seeds), which per device would differ from the whole micro-batch's")
        if any(a is not b for a, b in zip(new_metrics, metrics)):
            raise _NotLocal("the loss computation updates metric variables")
        count, exact = _loss_counts.combine(recording.counts)
        if count is None or not exact:
            raise _NotLocal("the loss is not a mean over a count of its entries (a 'sum' reduction, or several "
                            "losses whose counts need not be proportional), so the devices' losses do not "
                            "combine into the micro-batch's")
        if any(not leaf.shape for leaf in jax.tree_util.tree_leaves(y_pred)):
            raise _NotLocal("the model's outputs have no batch axis")
        stacked = [g[None] for g in grads]
        return stacked, jax.numpy.reshape(count, (1,)), jax.numpy.reshape(unscaled, (1,)), y_pred

    split, whole = PartitionSpec(axis.name), PartitionSpec()
    run = jax.shard_map(
        per_device,
        mesh=axis.mesh.backend_mesh,
        in_specs=(whole, whole, whole, whole, split, split, split),
        out_specs=split,
        axis_names={axis.name},
    )
    grads, counts, losses, y_pred = run(trainable, non_trainable, metrics, shared, x, y, sample_weight)
    total = jax.numpy.sum(counts)
    # The micro-batch's weight is its count (the devices' counts, each for
    # its own gradient) or, with weigh_by="batch", 1 (their shares of it).
    core.weights.per_device_next(counts if core.settings.weigh_by == "count" else counts / total)
    trainable, optimizer_values = optimizer.stateless_apply(optimizer_values, grads, trainable)
    loss = jax.numpy.sum(counts * losses) / total
    logs, metrics = model._update_metrics_variables(metrics, loss, x, y, y_pred, sample_weight)
    return logs, (trainable, non_trainable, optimizer_values, metrics)


# Models already warned about.
_warned: weakref.WeakSet = weakref.WeakSet()


def _warn(model: Any, why: str) -> None:
    if model in _warned:
        return
    _warned.add(model)
    warnings.warn(
        f"gradaccum: the gradients are all-reduced on every micro-step, not once per cycle, "
        f"because {why}. The result is the same; only the communication is not saved.",
        stacklevel=3,
    )
