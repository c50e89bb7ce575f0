"""The loop over a train step's micro-batches, per backend.

`gradaccum._micro_batches` decides that a train step is split and into how
many micro-batches; the loops here run Keras's original train step once per
micro-batch of `size` samples (the last one smaller where `size` does not
divide the batch), each in the backend's way of keeping one compiled body:

- JAX: `jax.lax.scan` over the full micro-batches (the batch reshaped to
  `[k, size, ...]`), carrying the train step's state; a ragged last
  micro-batch is one more call of the step, traced once more.
- PyTorch: a Python loop (its train step runs eagerly).
- TensorFlow: `tensorflow.micro_batches`, a `tf.while_loop`.

Each loop takes `splitting(count)`, the context in which the micro-steps
form one cycle of `count` micro-batches, and returns what Keras's train step
returns: the logs of the last micro-batch (metrics and the loss tracker
carry their state through every micro-batch, so these are the batch's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from keras import tree

from gradaccum._backend import active


def batch_size(data: Any) -> Any:
    """The size of the batch axis of `data`'s first tensor (None if unknown):
    of a `tf.distribute` iterator's element, the samples of every replica."""
    leaf = next(t for t in tree.flatten(data) if t is not None)
    if not hasattr(leaf, "shape"):
        from gradaccum._backend.tensorflow.micro_batches import replicas_batch_size

        return replicas_batch_size(leaf)
    return leaf.shape[0]


def replicas(model: Any) -> int:
    """The replicas that each compute an equal share of every micro-batch of
    `model`'s train step: a `tf.distribute` strategy's replicas in sync (1
    elsewhere: JAX's step takes the whole batch, sharded by its compiler)."""
    strategy = getattr(model, "distribute_strategy", None) if active() == "tensorflow" else None
    return 1 if strategy is None else strategy.num_replicas_in_sync


def writes_as_it_runs(model: Any) -> bool:
    """Whether `model`'s train step writes its variables as each op runs,
    on the host's word: PyTorch's, and TensorFlow's with `run_eagerly=True`.
    A `tf.function`'s writes wait on what they read, and JAX's step returns
    what it wrote."""
    backend = active()
    return backend == "torch" or (backend == "tensorflow" and bool(model.run_eagerly))


def unit(model: Any) -> int:
    """The samples every size `micro_batch_size="auto"` chooses for
    `model`'s train step is a multiple of, so that each device computes an
    equal share of a micro-batch: a `tf.distribute` strategy's replicas
    (`replicas`), or on JAX the devices `keras.distribution` splits the
    batch over (each device's gradients are then its own, all-reduced once
    per batch: `gradaccum._data_parallel`). With several JAX processes, 1:
    a process's batch is its own share of the devices' batch."""
    if active() != "jax":
        return replicas(model)
    if several_processes():
        return 1
    from gradaccum._backend.device_local import data_axis

    axis, _ = data_axis()
    return 1 if axis is None else axis.size


def copies(variables: list[Any]) -> list[Any]:
    """`variables`, each `tf.distribute` one as every replica's own copy:
    a replica-local variable's copies differ, and its own `assign` splits
    one value among them."""
    if active() != "tensorflow":
        return list(variables)
    from gradaccum._backend.tensorflow import distribution

    return [c for v in variables for c in distribution.copies(distribution.tf_variable(v))]


def _slice(data: Any, start: int, stop: int) -> Any:
    return tree.map_structure(lambda t: None if t is None else t[start:stop], data)


def _given(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of Keras's train step of the active backend
    by name: `step(state, data)` on JAX, `step(data)` elsewhere."""
    return dict(zip(("state", "data") if active() == "jax" else ("data",), args), **kwargs)


def step_data(args: tuple, kwargs: dict) -> Any:
    """The batch a call of Keras's train step (`args`, `kwargs`) is given."""
    return _given(args, kwargs).get("data")


def split_train_step(
    step: Callable[..., Any], args: tuple, kwargs: dict, size: int, splitting: Callable[[Any], Any], model: Any
) -> Any:
    """Keras's train step `step(*args, **kwargs)` of the active backend, run
    once per micro-batch of `size` samples, within `splitting(count)`;
    `model` is the model it trains."""
    given = _given(args, kwargs)
    if active() == "jax":
        return split_jax(step, given["state"], given["data"], size, splitting)
    if active() == "torch":
        return split_eagerly(step, given["data"], size, splitting)
    from gradaccum._backend.tensorflow.micro_batches import split

    return split(step, given["data"], size, splitting, model)


def batch_by_batch(args: tuple, steps: int, run: Callable[..., Any], model: Any) -> Any:
    """A call of Keras's train function of the active backend (`args`),
    made one call per batch, so that a batch is at hand to run again.

    Args:
        args: What Keras hands its train function: an iterator (TensorFlow),
            `fit`'s state and an iterator (JAX), a list of batches (PyTorch,
            handed over whole).
        steps: The batches one call takes (`steps_per_execution`).
        run: `run(call, data, state=None)` runs `call(function)`, with
            `function` a train function and `data` the batch it gets; JAX's
            `state` too, which it returns with the logs.
        model: The model `fit` trains.

    Returns:
        What Keras's train function returns: the logs (and on JAX the state).
    """
    backend = active()
    if backend == "torch":
        (batches,) = args
        return run(lambda function: function(batches), batches[0])
    state, iterator = args if backend == "jax" else (None, args[0])
    logs = None
    for data in _taken(iterator, steps):
        # Each batch is handed over alone, in an iterator of its own.
        if backend == "jax":
            try:
                logs, state = run(lambda f, s=state, d=data: f(s, iter([d])), data, state)
            except MemoryError:
                _keep_jax_state(model, state)
                raise
        else:
            logs = run(lambda f, d=data: f(iter([d])), data)
    return (logs, state) if backend == "jax" else logs


def made_anew(model: Any, state: Any) -> None:
    """Keras's `make_train_function(force=True)`. JAX's `fit` empties the
    model's variables while it holds their `state` apart, and under a
    `keras.distribution` Keras's function reads their shardings: they hold
    the state while it is made, and are emptied again after."""
    if state is None:
        model.make_train_function(force=True)
        return
    _keep_jax_state(model, state)
    try:
        model.make_train_function(force=True)
    finally:
        model._purge_model_variables(
            trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
        )
        # `fit` reads its state from the variables again only where they hold the newest.
        model._jax_state_synced = False


def _keep_jax_state(model: Any, state: Any) -> None:
    """Writes the state of JAX's `fit` (held apart from the model's
    variables while it runs) into the variables, as `fit` does when it ends:
    a step that cannot run leaves the model as the last step did."""
    names = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")
    model._jax_state = dict(zip(names, state))
    model._jax_state_synced = False
    model.jax_state_sync()


def _taken(iterator: Any, count: int) -> list[Any]:
    """Up to `count` batches of `iterator`, at least one (else StopIteration)."""
    taken = [next(iterator)]
    for _ in range(count - 1):
        try:
            taken.append(next(iterator))
        except StopIteration:
            break
    return taken


def split_eagerly(step: Callable[[Any], Any], data: Any, size: int, splitting: Callable[[Any], Any]) -> Any:
    """Keras's PyTorch train step `step(data)`, once per micro-batch."""
    total = int(batch_size(data))
    with splitting(math.ceil(total / size)):
        for start in range(0, total, size):
            logs = step(_slice(data, start, min(start + size, total)))
    return logs


def split_jax(
    step: Callable[[Any, Any], Any], state: Any, data: Any, size: int, splitting: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """Keras's JAX train step `step(state, data) -> (logs, state)`, once per
    micro-batch: a scan over the full ones, a call for a ragged last one."""
    import jax

    total = int(batch_size(data))
    full, rest = divmod(total, size)
    logs = None
    with splitting(full + (1 if rest else 0)):
        if full:

            def body(carry: Any, micro_batch: Any) -> tuple[Any, Any]:
                logs, carry = step(carry, micro_batch)
                return carry, logs

            stacked = tree.map_structure(
                lambda t: None if t is None else t[: full * size].reshape((full, size) + tuple(t.shape[1:])), data
            )
            state, every = jax.lax.scan(body, state, stacked)
            logs = tree.map_structure(lambda t: t[-1], every)
        if rest:
            logs, state = step(state, _slice(data, full * size, total))
    return logs, state


def donated_and_lost(state: Any) -> bool:
    """Whether a JAX step's `state` lost arrays it donated to a failed run."""
    return any(getattr(t, "is_deleted", lambda: False)() for t in tree.flatten(state) if t is not None)


def check_auto(model: Any) -> None:
    """Raises (ValueError) where `micro_batch_size="auto"` cannot choose for
    `model`'s train step (`tensorflow.micro_batches.check_auto`)."""
    if active() == "tensorflow":
        from gradaccum._backend.tensorflow import micro_batches

        micro_batches.check_auto(model)


def several_processes() -> bool:
    """Whether JAX runs several processes (each its own step)."""
    if active() != "jax":
        return False
    import jax

    return jax.process_count() > 1


def agreed(size: int) -> int:
    """The smallest of the sizes that JAX's processes chose (`size` where
    there is one process), so that every process traces the same step
    before its collectives."""
    if not several_processes():
        return size
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(size))))
