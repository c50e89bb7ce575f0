"""How an accumulating optimizer runs around a plain optimizer.

`Direct` hands each micro-step to the accumulating core, lists the core's
variables after the wrapped optimizer's (JAX's `fit` carries them), runs
`stateless_apply`, and persists through `gradaccum._persistence.Saved`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from keras.src.backend.common.stateless_scope import StatelessScope

from gradaccum import _backend, _families, _persistence
from gradaccum._core import Core
from gradaccum._settings import Settings


class Direct:
    """How an accumulating optimizer runs around a plain optimizer.

    Args:
        optimizer: The optimizer (not a loss-scale one).
        settings: The accumulation's settings.
    """

    def __init__(self, optimizer: Any, settings: Settings):
        family = _families.wrappable(optimizer)
        self.optimizer = optimizer
        self.family = family
        self.saved = _persistence.Saved(optimizer, family)
        self.core = Core(family, settings, _backend.for_active(), on_built=self.saved.on_built)
        self.saved.core = self.core
        if family.built:
            self.core.build(family.trainable_variables())

    def build(self, variables: Sequence[Any]) -> None:
        self.core.build(variables)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], weight: Any, **kwargs: Any) -> Any:
        options = self.family.apply_options(**kwargs)
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs)
            self.core.step(grads, variables, weight, options)
        return self.family.apply_gradients_result()

    def apply(self, grads: Sequence[Any], variables: Sequence[Any] | None, weight: Any) -> None:
        self.core.step(grads, variables, weight, {})

    @property
    def variables(self) -> Any:
        variables = self.optimizer.variables
        own = self.core.listed()
        return list(variables) + own if own else variables

    def stateless_apply(
        self, apply: Callable[..., None], optimizer_variables: Sequence[Any], grads: Sequence[Any],
        trainable_variables: Sequence[Any], weight: Any,
    ) -> tuple[list[Any], list[Any]]:
        core = self.core
        if _backend.active() == "tensorflow":
            raise NotImplementedError(
                "stateless_apply() of an accumulating optimizer is not available on the "
                "TensorFlow backend; call `apply()` or `apply_gradients()`."
            )
        if not core.built:
            raise ValueError(
                "To call `stateless_apply`, the accumulating optimizer must be "
                "built: call `optimizer.build(trainable_variables)` first."
            )
        own = list(self.variables)
        model = self.family.trainable_variables()
        if len(optimizer_variables) != len(own):
            raise ValueError(
                "Argument `optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(own)}, the wrapped optimizer's and the "
                f"accumulation state's). Received {len(optimizer_variables)}."
            )
        if len(trainable_variables) != len(model):
            raise ValueError(
                f"Argument `trainable_variables` must hold {len(model)} values (one per "
                f"variable the optimizer was built for). Received {len(trainable_variables)}."
            )
        mapping = list(zip(model, trainable_variables)) + list(zip(own, optimizer_variables))
        with StatelessScope(state_mapping=mapping) as scope:
            apply(list(grads), model, weight)
        return [scope.get_current_value(v) for v in model], [scope.get_current_value(v) for v in own]

    def save(self, store: Any) -> None:
        self.saved.save(store)

    def load(self, store: Any) -> None:
        self.saved.load(store)

    def children(self, save_type: str, **kwargs: Any) -> dict[str, Any]:
        return self.saved.children(save_type, **kwargs)

    def lookup(self, name: str, cached_dependencies: Any = None) -> Any:
        return self.saved.lookup(name, cached_dependencies)
