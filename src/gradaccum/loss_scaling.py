"""Loss scaling: accumulate inside a LossScaleOptimizer, never around it.

`accumulate(LossScaleOptimizer(opt), n)` must not patch the loss-scale
wrapper itself: its gradients are still scaled, and a step it skips for
non-finite gradients would still count as a micro-step. Instead the
loss-scale optimizer keeps its job — scale the loss, unscale the gradients,
drop a non-finite micro-batch and halve the scale — and its inner optimizer is
replaced by an accumulating one, which therefore only ever sees unscaled,
finite micro-gradients. A dropped micro-batch is neither added nor counted:
the cycle waits for `n` finite micro-batches, and those already accumulated
are kept.

`LossScaleOptimizer(accumulate(opt, n))` (also what `model.compile` builds
under a `mixed_float16` policy) needs nothing from here: the loss-scale
optimizer calls the accumulating one only for finite micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from gradaccum.adapters import _load_optional_families

# Loss-scale wrapper classes and the attribute that holds their inner
# optimizer. Other optimizer families add theirs with `_register`.
_WRAPPERS: list[tuple[Callable[[Any], bool], str]] = [
    (lambda o: isinstance(o, keras.optimizers.LossScaleOptimizer), "inner_optimizer"),
]


def _register(accepts: Callable[[Any], bool], inner_attribute: str) -> None:
    """Registers another loss-scale wrapper class by predicate and attribute."""
    entry = (accepts, inner_attribute)
    if entry not in _WRAPPERS:
        _WRAPPERS.append(entry)


def _inner_attribute(optimizer: Any) -> str | None:
    """The inner-optimizer attribute if `optimizer` is a loss-scale wrapper."""
    _load_optional_families()  # they register their wrappers here
    for accepts, attribute in _WRAPPERS:
        if accepts(optimizer):
            return attribute
    return None


def _install(optimizer: Any, attribute: str, wrap: Callable[[Any], Any]) -> Any:
    """Replaces the wrapper's inner optimizer by `wrap(inner)`; returns it."""
    core = wrap(getattr(optimizer, attribute))
    setattr(optimizer, attribute, core)
    delegating = tf.__internal__.tracking.DelegatingTrackableMixin
    if isinstance(optimizer, delegating):
        # tf_keras's loss-scale optimizer for OptimizerV2 hands every
        # checkpoint call to the inner optimizer it was created with; point it
        # at the core, or checkpoints would miss the accumulation state.
        delegating.__init__(optimizer, core)
    return core
