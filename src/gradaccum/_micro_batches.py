"""Micro-batches inside `model.fit`'s train step: `accumulate(opt, micro_batch_size=m)`.

`fit(batch_size=B)` keeps `B` as the batch the user means: Keras's original
train step runs once per micro-batch of `m` samples of the batch (the last
one smaller where `m` does not divide `B`), and the accumulating core makes
those `k = ceil(B / m)` micro-steps one cycle (`Cycle.splitting`). So the
optimizer applies once per batch, `iterations`, schedules, callbacks and
checkpoints count updates, and everything a micro-step does (loss counts,
kept `tf.IndexedSlices`, loss scaling, AGC) is the accumulation's own.

Keras's train step of each backend is wrapped (see `gradaccum._patches`);
the loop over micro-batches is the backend's
(`gradaccum._backend.split_train_step`). A step that calls Keras's own
(`super().train_step(data)`) is split there. A model that overrides
`train_step` with a step of its own is not split: its `apply_gradients`
then raises, saying to accumulate across steps with `n` (see `Core.step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from keras import ops

from gradaccum import _backend, _families
from gradaccum._atomic import unchanged_if_raised


def _splitting(model: Any) -> Any:
    """The core that splits `model`'s train step, or None."""
    core = _families.core_in(getattr(model, "optimizer", None))
    if core is None or core.settings.micro_batch_size is None or core.cycle.split is not None:
        return None
    return core


def train_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's `train_step` of the TensorFlow, JAX and PyTorch trainers,
    split into micro-batches for a model whose optimizer has a
    `micro_batch_size`."""
    core = _splitting(instance)
    if core is None:
        return wrapped(*args, **kwargs)
    return _backend.split_train_step(
        wrapped, args, kwargs, core.settings.micro_batch_size, functools.partial(_splitting_into, core), instance
    )


@contextlib.contextmanager
def _splitting_into(core: Any, count: Any, defer: bool = False) -> Iterator[Callable[[Any], None]]:
    """Runs the block's micro-steps as one cycle of `count` micro-batches.

    With `defer`, they only accumulate, each at the index the loop running
    them hands the function the block gets, and the cycle's update runs once
    the block's loop is done: a loop whose body cannot hold the update (a
    `tf.distribute` strategy's merge calls and all-reduce).
    """
    cycle = core.cycle
    with cycle.splitting(count, defer):
        yield cycle.at
        if defer:
            cycle.at(None)
            state, ends, given = core.state, ops.convert_to_tensor(True), cycle.given
            state.mark_touched(given, ends)
            with unchanged_if_raised(state, core.backend, ends):
                core._finish_if(ends, count, given)


def check_family(settings: Any, family: Any) -> None:
    """Raises if `settings` ask for a `micro_batch_size` with an optimizer
    whose `fit` is not split (only Keras 3's train steps are).

    Raises:
        ValueError: Naming the optimizer's library.
    """
    if settings.micro_batch_size is not None and family.name != "Keras 3":
        raise ValueError(
            f"micro_batch_size={settings.micro_batch_size} splits Keras 3's train step inside `model.fit`; "
            f"a {family.name} optimizer's `fit` is not split. Accumulate across steps with "
            "accumulate(optimizer, n=k) and batches of B / k."
        )
