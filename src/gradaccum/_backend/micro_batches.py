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

from keras import tree


def batch_size(data: Any) -> Any:
    """The size of the batch axis of `data`'s first tensor (None if unknown)."""
    leaf = next(t for t in tree.flatten(data) if t is not None)
    return leaf.shape[0]


def _slice(data: Any, start: int, stop: int) -> Any:
    return tree.map_structure(lambda t: None if t is None else t[start:stop], data)


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
